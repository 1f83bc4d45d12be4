/* C helpers compiled into skippy._llama next to the cffi wrappers.
 *
 * They exist where doing the same from Python would cost a Python-level loop per batch row:
 * pointing a llama_batch at caller-owned arrays (zero copy), and sampling several rows in one
 * call.  They hold no state and never allocate.
 */
#include <stdint.h>
#include <stddef.h>
#include "llama.h"

const char * const skippy_binding_stamp = SKIPPY_BINDING_STAMP;

/* Point `batch` at caller-owned arrays; seq_ptrs[i] is set to &seq_ids[i] (one sequence per row).
 * Exactly one of tokens / embd is non-NULL. */
void skippy_batch_view(struct llama_batch * batch, int32_t n_tokens, llama_token * tokens, float * embd,
                       llama_pos * pos, int32_t * n_seq_id, llama_seq_id ** seq_ptrs, llama_seq_id * seq_ids,
                       int8_t * outputs) {
    for (int32_t i = 0; i < n_tokens; ++i) {
        n_seq_id[i] = 1;
        seq_ptrs[i] = &seq_ids[i];
    }
    batch->n_tokens = n_tokens;
    batch->token    = tokens;
    batch->embd     = embd;
    batch->pos      = pos;
    batch->n_seq_id = n_seq_id;
    batch->seq_id   = seq_ptrs;
    batch->logits   = outputs;
}

/* Sample output row rows[i] of the last decode with samplers[i]; returns the number sampled. */
int32_t skippy_sample_rows(struct llama_sampler ** samplers, struct llama_context * ctx, const int32_t * rows,
                           int32_t n_rows, llama_token * out) {
    for (int32_t i = 0; i < n_rows; ++i) {
        out[i] = llama_sampler_sample(samplers[i], ctx, rows[i]);
    }
    return n_rows;
}

/* Cells in use: the sum over sequences [0, n_seq) of their position span (pos_max - pos_min + 1). */
size_t skippy_kv_cells_used(struct llama_context * ctx, int32_t n_seq) {
    llama_memory_t mem = llama_get_memory(ctx);
    size_t used = 0;
    for (int32_t s = 0; s < n_seq; ++s) {
        const llama_pos lo = llama_memory_seq_pos_min(mem, s);
        const llama_pos hi = llama_memory_seq_pos_max(mem, s);
        if (lo >= 0 && hi >= lo) {
            used += (size_t) (hi - lo + 1);
        }
    }
    return used;
}
