/* C helpers compiled into skippy._llama next to the cffi wrappers.
 *
 * They exist where doing the same from Python would cost a Python-level loop per batch row:
 * pointing a llama_batch at caller-owned arrays (zero copy), and sampling several rows in one
 * call.  They hold no state and never allocate.
 */
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include "llama.h"
#include "skippy_relay_calls.h"

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

/* llama_decode of the batch `batch` points to: the decode relay (skippy/stage/_relay.pyx) calls it
 * through a plain function pointer, which cannot pass a struct by value. */
int32_t skippy_decode_view(struct llama_context * ctx, const struct llama_batch * batch) {
    return llama_decode(ctx, *batch);
}

/* Keep positions [0, length) of sequence `seq` (StageContext.trim of a non-recurrent context); 0: trimmed. */
int32_t skippy_trim_view(struct llama_context * ctx, int32_t seq, int32_t length) {
    return llama_memory_seq_rm(llama_get_memory(ctx), seq, length, -1) ? 0 : 1;
}

/* The relay's calls (skippy_relay_calls.h): the compiler checks each entry against its declaration
 * (a mismatch is an error, not a warning). */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wincompatible-pointer-types"
#endif
static const struct skippy_relay_calls relay_calls = {
    skippy_decode_view, llama_get_embeddings, llama_get_logits_ith, llama_sampler_sample, skippy_trim_view,
};
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

const void * skippy_relay_calls(void) {
    return &relay_calls;
}

/* Sample output row rows[i] of the last decode with samplers[i]; returns the number sampled. */
int32_t skippy_sample_rows(struct llama_sampler ** samplers, struct llama_context * ctx, const int32_t * rows,
                           int32_t n_rows, llama_token * out) {
    for (int32_t i = 0; i < n_rows; ++i) {
        out[i] = llama_sampler_sample(samplers[i], ctx, rows[i]);
    }
    return n_rows;
}

static void skippy_fill_candidates(const float * logits, int32_t n_vocab, llama_token_data * scratch) {
    for (llama_token token = 0; token < n_vocab; ++token) {
        scratch[token].id = token;
        scratch[token].logit = logits[token];
        scratch[token].p = 0.0f;
    }
}

/* The candidate `smpl` picked from `candidates`, or -1 when it picked none or a forbidden one. */
static llama_token skippy_picked(const llama_token_data_array * candidates, int32_t n_vocab) {
    if (candidates->selected < 0 || candidates->selected >= (int64_t) candidates->size) {
        return -1;
    }
    const llama_token_data picked = candidates->data[candidates->selected];
    if (!(picked.logit > -INFINITY) || picked.id < 0 || picked.id >= n_vocab) {
        return -1;
    }
    return picked.id;
}

/* Sample one row (its `logits`, n_vocab floats) under a grammar, as llama_sampler_sample does, but
 * refusing instead of accepting a token the grammar forbids: when a grammar forbids every token the
 * chain still "picks" one, and accepting it would throw inside llama.cpp (an exception through the
 * C API ends the process).  `scratch` holds n_vocab entries, owned by the caller.
 *
 * grammar == NULL: the grammar is inside `chain`; apply the chain, check the pick, accept it.
 * grammar != NULL: the chain has none and its transforms commute with the grammar's mask (greedy,
 * or temperature and a draw): first the chain picks from every token; when the grammar allows that
 * pick it is the answer (the constrained argmax, or a draw from the masked distribution: a draw
 * from p that lands on an allowed token, else a draw from p restricted to the allowed tokens, gives
 * each allowed token p / P(allowed)); otherwise the grammar masks the candidates and the chain picks
 * again.  The first try costs one grammar check instead of a pass over the vocabulary.
 * Returns 0 with *out set, or -1 (nothing accepted). */
int32_t skippy_sample_row_checked(struct llama_sampler * chain, struct llama_sampler * grammar, const float * logits,
                                  int32_t n_vocab, llama_token_data * scratch, llama_token * out) {
    skippy_fill_candidates(logits, n_vocab, scratch);
    llama_token_data_array candidates = { scratch, (size_t) n_vocab, -1, false };
    llama_sampler_apply(chain, &candidates);
    llama_token token = skippy_picked(&candidates, n_vocab);
    if (grammar != NULL) {
        if (token >= 0) {
            llama_token_data one = { token, 0.0f, 0.0f };
            llama_token_data_array single = { &one, 1, -1, false };
            llama_sampler_apply(grammar, &single);
            if (!(one.logit > -INFINITY)) {
                token = -1;
            }
        }
        if (token < 0) {
            skippy_fill_candidates(logits, n_vocab, scratch);
            llama_token_data_array masked = { scratch, (size_t) n_vocab, -1, false };
            llama_sampler_apply(grammar, &masked);
            llama_sampler_apply(chain, &masked);
            token = skippy_picked(&masked, n_vocab);
        }
        if (token < 0) {
            return -1;
        }
        llama_sampler_accept(grammar, token);
    } else if (token < 0) {
        return -1;
    }
    llama_sampler_accept(chain, token);
    *out = token;
    return 0;
}

/* Apply `smpl` `n` times to a one-candidate array: a seeded dist sampler draws once per apply
   (llama_sampler_dist_apply's size-1 path), so this moves its RNG to where n samples left it
   (docs/protocol.md §14: a replaced final stage restores a session's sampler). */
void skippy_sampler_draw(struct llama_sampler * smpl, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
        llama_token_data one = { 0, 0.0f, 0.0f };
        llama_token_data_array single = { &one, 1, -1, false };
        llama_sampler_apply(smpl, &single);
    }
}

/* Whether `grammar` allows `token` next (a one-candidate apply; accepting a forbidden token would
   throw through the C API). */
int32_t skippy_grammar_allows(struct llama_sampler * grammar, llama_token token) {
    llama_token_data one = { token, 0.0f, 0.0f };
    llama_token_data_array single = { &one, 1, -1, false };
    llama_sampler_apply(grammar, &single);
    return one.logit > -INFINITY ? 1 : 0;
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
