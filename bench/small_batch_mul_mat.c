// Time one ggml CPU mul_mat of a [K x M] weight (given type) by n F32 columns: ms per batch.
// Built and run by bench/small_batch.py against two ggml builds (tinyBLAS on / off, or before /
// after a patch) via LD_LIBRARY_PATH; prints "type K M n threads cpu_ms wall_ms" per case.
// usage: small_batch_mul_mat THREADS TYPE:K:M[,TYPE:K:M...] N[,N...] [MIN_MS]
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static enum ggml_type type_named(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((enum ggml_type) t);
        if (n && strcmp(n, name) == 0) {
            return (enum ggml_type) t;
        }
    }
    fprintf(stderr, "unknown type %s\n", name);
    exit(2);
}

static int cmp(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static void run(int threads, enum ggml_type type, int64_t K, int64_t M, int n, double min_ms) {
    size_t wsize = ggml_row_size(type, K) * M;
    struct ggml_init_params ip = { wsize + (size_t) (K + M) * n * 4 * 4 + 64 * ggml_tensor_overhead() + ggml_graph_overhead() + (64 << 20), NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, K, M);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, n);
    float * row = malloc(sizeof(float) * K);
    srand(1);
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t k = 0; k < K; ++k) {
            row[k] = (float) rand() / RAND_MAX - 0.5f;
        }
        if (type == GGML_TYPE_F32) {
            memcpy((char *) w->data + r * w->nb[1], row, K * 4);
        } else if (type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(row, (ggml_fp16_t *) ((char *) w->data + r * w->nb[1]), K);
        } else {
            ggml_quantize_chunk(type, row, (char *) w->data + r * w->nb[1], 0, 1, K, NULL);
        }
    }
    free(row);
    for (int64_t i = 0; i < K * n; ++i) {
        ((float *) x->data)[i] = (float) rand() / RAND_MAX - 0.5f;
    }
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, y);
    ggml_graph_compute_with_ctx(ctx, g, threads);  // warm
    enum { REPS = 7 };
    double cpu[REPS], wall[REPS];
    for (int rep = 0; rep < REPS; ++rep) {
        int iters = 0;
        double c0 = now(CLOCK_PROCESS_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
        do {
            ggml_graph_compute_with_ctx(ctx, g, threads);
            ++iters;
        } while (now(CLOCK_MONOTONIC) - w0 < min_ms);
        cpu[rep] = (now(CLOCK_PROCESS_CPUTIME_ID) - c0) / iters;
        wall[rep] = (now(CLOCK_MONOTONIC) - w0) / iters;
    }
    qsort(cpu, REPS, sizeof(double), cmp);
    qsort(wall, REPS, sizeof(double), cmp);
    printf("%s %lld %lld %d %d %.4f %.4f\n", ggml_type_name(type), (long long) K, (long long) M, n, threads,
           cpu[REPS / 2], wall[REPS / 2]);
    fflush(stdout);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s THREADS TYPE:K:M[,...] N[,N...] [MIN_MS]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    double min_ms = argc > 4 ? atof(argv[4]) : 20.0;
    ggml_cpu_init();
    char * shapes = strdup(argv[2]);
    for (char * s = strtok(shapes, ","); s; s = strtok(NULL, ",")) {
        char name[32];
        long long K, M;
        if (sscanf(s, "%31[^:]:%lld:%lld", name, &K, &M) != 3) {
            fprintf(stderr, "bad shape %s\n", s);
            return 2;
        }
        char * ns = strdup(argv[3]);
        char * save = NULL;
        for (char * t = strtok_r(ns, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            run(threads, type_named(name), K, M, atoi(t), min_ms);
        }
        free(ns);
    }
    return 0;
}
