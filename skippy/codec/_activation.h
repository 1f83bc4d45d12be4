/* Activation kernels of skippy/codec/_wire.pyx, in C so that the compiler sees plain branch-free
 * loops it can vectorise (Cython lowers conditional expressions to if/else blocks).
 *
 * Portable build flags mean SSE2 on x86-64: no F16C, no per-lane variable shifts, no unsigned or
 * 32-bit min/max instructions. So every loop below uses only operations SSE2 vectorises: uniform
 * shifts, signed 32-bit compares turned into selects, and float arithmetic whose results are
 * exact. Float compares are avoided entirely: under the default -ftrapping-math gcc refuses to
 * if-convert them, which is what kept the first q8 kernel scalar. Selects are integer
 * masks (skippy_select), so there is no branch left to if-convert.
 *
 * f16 (protocol.md §4.2) rounds ties away from zero. Normals: add half an ulp to the f32 bits and
 * truncate. Subnormals (|x| < 2^-14): y = |x| * 2^24 is exact (a power-of-two scale of a value
 * clamped to <= 2^-14, so y <= 1024), and the half's bits are round_half_away(y); truncation plus
 * the exact fraction y - trunc(y) gives that without a variable shift. A result of 1024 is
 * exactly the smallest normal, as a carry would give. NaN -> 0x7E00, >= 65520 -> infinity.
 * Decoding is exact: normals and specials by rebiasing the exponent, subnormals as m x 2^-24
 * (an int -> float conversion and a power-of-two scale, both exact); NaN payloads are kept.
 *
 * q8 (protocol.md §4.2): [rows x f32 scale][rows x width x i8], scale = max|x| / 127 (1.0 for an
 * all-zero row), q = clamp(round_half_away(x / scale), -127, 127), NaN quotients become 0 (as
 * Rust's saturating cast). The row maximum is taken over the bit patterns of |x| -- the same order
 * as the values for non-NaN floats -- with NaNs counted as 0, which is f32::max's NaN rule.
 * The division is kept (multiplying by 1/scale changes bytes); IEEE division is correctly
 * rounded, so the vector divps gives the scalar divss's bits. After it, the quotient's sign and
 * magnitude are separated on the bits: NaN magnitudes become 0, magnitudes clamp at 127.5, and
 * round_half_away(|q|) is trunc(|q|) + (|q| - trunc(|q|) >= 0.5), the fraction being exact and
 * compared on its bits. tests/test_wire.py checks these kernels against the twin's numpy code and
 * the golden vectors; the derivation was also checked exhaustively over all 2^32 f32 inputs
 * against the previous scalar kernels.
 */
#ifndef SKIPPY_ACTIVATION_H
#define SKIPPY_ACTIVATION_H

#include <stdint.h>
#include <string.h>
#include "_byteorder.h"

static inline int32_t skippy_float_bits(float value) {
    int32_t bits; memcpy(&bits, &value, 4); return bits;
}
static inline float skippy_bits_float(int32_t bits) {
    float value; memcpy(&value, &bits, 4); return value;
}
/* condition ? a : b with a mask, so that gcc keeps no branch it would have to if-convert. */
static inline int32_t skippy_select(int32_t condition, int32_t a, int32_t b) {
    return b ^ ((a ^ b) & -condition);
}

/* round_half_away(y) for 0 <= y < 2^23. */
static inline int32_t skippy_round_half_away(float y) {
    int32_t truncated = (int32_t)y;
    return truncated + (skippy_float_bits(y - (float)truncated) >= 0x3F000000); /* 0.5f */
}

static inline uint16_t skippy_f32_bits_to_f16(uint32_t bits) {
    int32_t sign = (int32_t)((bits >> 16) & 0x8000u);
    int32_t magnitude = (int32_t)(bits & 0x7FFFFFFFu);
    int32_t normal = (int32_t)((((uint32_t)magnitude - 0x38000000u) + 0x1000u) >> 13);
    int32_t small = skippy_select(magnitude < 0x38800000, magnitude, 0x38800000);  /* <= 2^-14 */
    int32_t subnormal = skippy_round_half_away(skippy_bits_float(small) * 16777216.0f);
    int32_t half = skippy_select(magnitude >= 0x38800000, normal, subnormal);
    half = skippy_select(magnitude >= 0x47800000, 0x7C00, half);
    half = skippy_select(magnitude > 0x7F800000, 0x7E00, half);
    return (uint16_t)(half | sign);
}

static inline uint32_t skippy_f16_to_f32_bits(uint32_t half) {
    uint32_t sign = (half & 0x8000u) << 16;
    int32_t magnitude = (int32_t)(half & 0x7FFFu);
    int32_t normal = (magnitude << 13) + (112 << 23);
    int32_t special = normal + (112 << 23);  /* exponent 31 -> 255, payload kept */
    int32_t subnormal = skippy_float_bits((float)(magnitude & 0x3FF) * 5.9604644775390625e-08f);
    int32_t value = skippy_select(magnitude < 0x400, subnormal, normal);
    value = skippy_select(magnitude >= 0x7C00, special, value);
    return sign | (uint32_t)value;
}

static inline void skippy_encode_f16_portable(const uint32_t *source, unsigned char *target,
                                     Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        skippy_store_u16(target + 2 * i, skippy_f32_bits_to_f16(source[i]));
    }
}

static inline void skippy_decode_f16_portable(const unsigned char *source, uint32_t *target,
                                     Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        target[i] = skippy_f16_to_f32_bits(skippy_load_u16(source + 2 * i));
    }
}

/* q = clamp(round_half_away(quotient), -127, 127), NaN -> 0. */
static inline int8_t skippy_q8_round(float quotient) {
    int32_t bits = skippy_float_bits(quotient);
    int32_t negative = bits >> 31;  /* 0 or -1 */
    int32_t magnitude = bits & 0x7FFFFFFF;
    magnitude = skippy_select(magnitude > 0x7F800000, 0, magnitude);           /* NaN */
    magnitude = skippy_select(magnitude > 0x42FF0000, 0x42FF0000, magnitude);  /* 127.5f */
    int32_t rounded = skippy_round_half_away(skippy_bits_float(magnitude));
    rounded = skippy_select(rounded > 127, 127, rounded);
    return (int8_t)((rounded ^ negative) - negative);
}

static inline void skippy_encode_q8_portable(const float *source, unsigned char *target,
                                    Py_ssize_t rows, Py_ssize_t width) {
    int8_t *quantized = (int8_t *)(target + 4 * rows);
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *values = source + row * width;
        int32_t max_bits = 0;
        for (Py_ssize_t column = 0; column < width; column++) {
            int32_t bits = skippy_float_bits(values[column]) & 0x7FFFFFFF;
            bits = bits > 0x7F800000 ? 0 : bits;
            max_bits = bits > max_bits ? bits : max_bits;
        }
        float scale = max_bits == 0 ? 1.0f : skippy_bits_float(max_bits) / 127.0f;
        skippy_store_f32(target + 4 * row, scale);
        int8_t *out = quantized + row * width;
        for (Py_ssize_t column = 0; column < width; column++) {
            out[column] = skippy_q8_round(values[column] / scale);
        }
    }
}

/* Run-time dispatch: the AVX2/F16C kernels of _activation_x86.h where the CPU has them, the
 * portable loops above otherwise. Both write the same bytes; skippy_activation_select(0) forces
 * the portable ones (tests compare the two). Selected once at module import, before any
 * conversion runs, so the nogil loops only read the flag. */
#include "_activation_x86.h"

static int skippy_activation_accelerated = 0;

static int skippy_activation_select(int accelerated) {
#ifdef SKIPPY_HAVE_X86_KERNELS
    skippy_activation_accelerated = accelerated && skippy_x86_kernels_supported();
#else
    (void)accelerated;
    skippy_activation_accelerated = 0;
#endif
    return skippy_activation_accelerated;
}

static inline void skippy_encode_f16(const uint32_t *source, unsigned char *target,
                                     Py_ssize_t count) {
#ifdef SKIPPY_HAVE_X86_KERNELS
    if (skippy_activation_accelerated) {
        skippy_encode_f16_avx2(source, target, count);
        return;
    }
#endif
    skippy_encode_f16_portable(source, target, count);
}

static inline void skippy_decode_f16(const unsigned char *source, uint32_t *target,
                                     Py_ssize_t count) {
#ifdef SKIPPY_HAVE_X86_KERNELS
    if (skippy_activation_accelerated) {
        skippy_decode_f16_avx2(source, target, count);
        return;
    }
#endif
    skippy_decode_f16_portable(source, target, count);
}

static inline void skippy_encode_q8(const float *source, unsigned char *target,
                                    Py_ssize_t rows, Py_ssize_t width) {
#ifdef SKIPPY_HAVE_X86_KERNELS
    if (skippy_activation_accelerated) {
        skippy_encode_q8_avx2(source, target, rows, width);
        return;
    }
#endif
    skippy_encode_q8_portable(source, target, rows, width);
}

#endif /* SKIPPY_ACTIVATION_H */
