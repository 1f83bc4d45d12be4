/* Little-endian loads and stores for the stage wire codec (skippy/codec/_wire.pyx).
 *
 * The wire is little-endian with no alignment anywhere (protocol.md §2.1), so every access goes
 * through memcpy, which compilers turn into a single (unaligned) move, plus a byte swap on
 * big-endian hosts. This header is the only place that knows the host byte order.
 */
#ifndef SKIPPY_BYTEORDER_H
#define SKIPPY_BYTEORDER_H

#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define SKIPPY_HOST_LITTLE_ENDIAN 0
#define SKIPPY_SWAP16(x) __builtin_bswap16(x)
#define SKIPPY_SWAP32(x) __builtin_bswap32(x)
#define SKIPPY_SWAP64(x) __builtin_bswap64(x)
#else
#define SKIPPY_HOST_LITTLE_ENDIAN 1
#define SKIPPY_SWAP16(x) (x)
#define SKIPPY_SWAP32(x) (x)
#define SKIPPY_SWAP64(x) (x)
#endif

static inline uint16_t skippy_load_u16(const unsigned char *p) {
    uint16_t v; memcpy(&v, p, 2); return SKIPPY_SWAP16(v);
}
static inline uint32_t skippy_load_u32(const unsigned char *p) {
    uint32_t v; memcpy(&v, p, 4); return SKIPPY_SWAP32(v);
}
static inline int32_t skippy_load_i32(const unsigned char *p) {
    return (int32_t)skippy_load_u32(p);
}
static inline uint64_t skippy_load_u64(const unsigned char *p) {
    uint64_t v; memcpy(&v, p, 8); return SKIPPY_SWAP64(v);
}
static inline int64_t skippy_load_i64(const unsigned char *p) {
    return (int64_t)skippy_load_u64(p);
}
static inline float skippy_load_f32(const unsigned char *p) {
    uint32_t bits = skippy_load_u32(p); float v; memcpy(&v, &bits, 4); return v;
}
static inline void skippy_store_u16(unsigned char *p, uint16_t v) {
    v = SKIPPY_SWAP16(v); memcpy(p, &v, 2);
}
static inline void skippy_store_u32(unsigned char *p, uint32_t v) {
    v = SKIPPY_SWAP32(v); memcpy(p, &v, 4);
}
static inline void skippy_store_i32(unsigned char *p, int32_t v) {
    skippy_store_u32(p, (uint32_t)v);
}
static inline void skippy_store_u64(unsigned char *p, uint64_t v) {
    v = SKIPPY_SWAP64(v); memcpy(p, &v, 8);
}
static inline void skippy_store_i64(unsigned char *p, int64_t v) {
    skippy_store_u64(p, (uint64_t)v);
}
static inline void skippy_store_f32(unsigned char *p, float v) {
    uint32_t bits; memcpy(&bits, &v, 4); skippy_store_u32(p, bits);
}
/* Bulk copies of i32/f32 arrays (sidebands, f32 activations) are plain memcpy, so _wire.pyx
 * refuses to import on big-endian hosts (SKIPPY_HOST_LITTLE_ENDIAN == 0) and wire.py falls back
 * to the pure twin, which handles any host through numpy's explicit "<i4"/"<f4" dtypes. */

#endif /* SKIPPY_BYTEORDER_H */
