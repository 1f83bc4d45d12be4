/* The llama.cpp calls the decode relay (skippy/stage/_relay.pyx) makes, as one table of typed function
 * pointers.  skippy._llama (skippy_shim.c, compiled against llama.h) fills it with the functions
 * themselves, so the C compiler checks every pointer's type against their declarations; the relay
 * includes this header for the same types and gets the table from skippy_relay_calls().
 */
#ifndef SKIPPY_RELAY_CALLS_H
#define SKIPPY_RELAY_CALLS_H

#include <stdint.h>

struct llama_context;
struct llama_batch;
struct llama_sampler;

struct skippy_relay_calls {
    /* skippy_decode_view: llama_decode of the batch a view points to (0: decoded) */
    int32_t (*decode)(struct llama_context * ctx, const struct llama_batch * batch);
    /* llama_get_embeddings: the output rows' activations */
    float * (*embeddings)(struct llama_context * ctx);
    /* llama_get_logits_ith: one output row's logits (NULL: none) */
    float * (*logits)(struct llama_context * ctx, int32_t i);
    /* llama_sampler_sample: a sampler chain's token for one output row */
    int32_t (*sample)(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
    /* skippy_trim_view: keep positions [0, length) of sequence seq (the auto-align of a rollback; 0: trimmed) */
    int32_t (*trim)(struct llama_context * ctx, int32_t seq, int32_t length);
};

#endif
