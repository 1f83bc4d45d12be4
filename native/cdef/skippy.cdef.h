/* The subset of llama.h (plus skippy's layer-range additions) that skippy calls, as cffi cdef.
 *
 * cffi API mode: structs list only the fields we touch and end in "...;", enums are written
 * with "...", so the C compiler fixes every layout and value; nothing is mirrored by hand.
 * Helper functions prefixed skippy_ are defined in skippy_shim.c.
 */

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
typedef struct llama_memory_i * llama_memory_t;

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;

enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
                      GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ... };
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

enum llama_load_mode { LLAMA_LOAD_MODE_AUTO, LLAMA_LOAD_MODE_NONE, LLAMA_LOAD_MODE_MMAP, ... };
enum llama_lazy_mode { LLAMA_LAZY_MODE_OFF, LLAMA_LAZY_MODE_AUTO, LLAMA_LAZY_MODE_ON, ... };
enum llama_model_kv_override_type { LLAMA_KV_OVERRIDE_TYPE_INT, LLAMA_KV_OVERRIDE_TYPE_FLOAT,
                                    LLAMA_KV_OVERRIDE_TYPE_BOOL, LLAMA_KV_OVERRIDE_TYPE_STR, ... };
enum llama_pooling_type { LLAMA_POOLING_TYPE_UNSPECIFIED, LLAMA_POOLING_TYPE_NONE, ... };
enum llama_flash_attn_type { LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED,
                             LLAMA_FLASH_ATTN_TYPE_ENABLED, ... };
enum llama_split_mode { LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, ... };
enum ggml_type { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, ... };

/* ggml backends and devices (libggml / libggml-base) */
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU,
                             GGML_BACKEND_DEVICE_TYPE_ACCEL, ... };

typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_kv_override {
    enum llama_model_kv_override_type tag;
    char key[128];
    int64_t val_i64;
    ...;
};

struct llama_model_params {
    ggml_backend_dev_t * devices;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    int32_t main_gpu;
    enum llama_load_mode load_mode;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const struct llama_model_kv_override * kv_overrides;
    bool vocab_only;
    bool check_tensors;
    enum llama_lazy_mode lazy_mode;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_pooling_type pooling_type;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool kv_unified;
    ...;
};

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

struct llama_sampler_chain_params {
    bool no_perf;
    ...;
};

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

#define LLAMA_STAGE_ABI_VERSION ...

/* backend, logging */
void llama_backend_init(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
size_t ggml_backend_reg_count(void);
ggml_backend_reg_t ggml_backend_reg_get(size_t index);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
ggml_backend_reg_t ggml_backend_load(const char * path);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);

/* model */
struct llama_model_params llama_model_default_params(void);
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_embd_inp(const struct llama_model * model);
int32_t llama_model_n_embd_out(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);

/* skippy layer range (native/patches) */
int32_t llama_stage_abi_version(void);
const char * llama_stage_arch_refusal(const char * arch_name);
int32_t llama_model_stage_layer_start(const struct llama_model * model);
int32_t llama_model_stage_layer_end(const struct llama_model * model);
bool llama_model_stage_has_head(const struct llama_model * model);
int32_t llama_model_stage_head_row_start(const struct llama_model * model);
int32_t llama_model_stage_head_row_end(const struct llama_model * model);

/* context */
struct llama_context_params llama_context_default_params(void);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings(struct llama_context * ctx);
float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);

/* KV memory */
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

/* per-sequence state */
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
/* flags: 1 = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (a hybrid's recurrent state without its attention KV) */
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, uint32_t flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, uint32_t flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id, uint32_t flags);

/* sampling */
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str,
                                                  const char * grammar_root);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);

void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);

/* tokenizer (vocab-only loads) */
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len, llama_token * tokens,
                       int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                             int32_t lstrip, bool special);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);

/* skippy_shim.c */
extern const char * const skippy_binding_stamp;
void skippy_batch_view(struct llama_batch * batch, int32_t n_tokens, llama_token * tokens, float * embd,
                       llama_pos * pos, int32_t * n_seq_id, llama_seq_id ** seq_ptrs, llama_seq_id * seq_ids,
                       int8_t * outputs);
int32_t skippy_decode_view(struct llama_context * ctx, const struct llama_batch * batch);
const void * skippy_relay_calls(void);
int32_t skippy_trim_view(struct llama_context * ctx, int32_t seq, int32_t length);
int32_t skippy_sample_rows(struct llama_sampler ** samplers, struct llama_context * ctx, const int32_t * rows,
                           int32_t n_rows, llama_token * out);
int32_t skippy_sample_row_checked(struct llama_sampler * chain, struct llama_sampler * grammar, const float * logits,
                                  int32_t n_vocab, llama_token_data * scratch, llama_token * out);
void skippy_sampler_draw(struct llama_sampler * smpl, int32_t n);
int32_t skippy_grammar_allows(struct llama_sampler * grammar, llama_token token);
size_t skippy_kv_cells_used(struct llama_context * ctx, int32_t n_seq);

/* callbacks into Python (skippy/runtime/_callbacks.py) */
extern "Python" void skippy_on_log(enum ggml_log_level level, const char * text, void * user_data);
extern "Python" bool skippy_on_progress(float progress, void * user_data);
