/* AVX2 + F16C versions of the activation kernels of _activation.h, chosen at run time.
 *
 * Included by _activation.h after the portable kernels (it uses their scalar helpers for loop
 * tails). The functions carry __attribute__((target("avx2,f16c"))), so the rest of the module
 * keeps the portable x86-64 baseline and these run only where skippy_x86_kernels_supported()
 * (cpuid, with the OS saving the YMM state) says so. Compiled only by gcc >= 5 and clang on
 * x86-64; anything else defines no SKIPPY_HAVE_X86_KERNELS and gets the portable loops. No "fma"
 * in the target list: nothing here gains from it, and without it the compiler cannot contract a
 * multiply and an add into an fma that rounds differently.
 *
 * Every kernel produces the bytes of its portable twin (checked exhaustively: all 2^32 f32 inputs
 * through f16 encode, all 2^16 halves through decode, the q8 rounding over all 2^32 quotients):
 *
 * f16 encode: vcvtps2ph with round-to-nearest-even, after making every tie a non-tie. The
 * reference rounds ties away from zero; both round every other value to the nearest half, and at
 * a tie ties-to-even either agrees or rounds toward zero. So a tie's f32 bits get +1 (one f32 ulp
 * further from zero; it stays in its binade and far below the next tie), after which nearest-even
 * rounds it away from zero too. Ties are detected exactly: in the f16 normal range (|x| >= 2^-14)
 * the 13 dropped mantissa bits are 0x1000; below it, y = |x| * 2^24 is exact (y <= 1024) and x is
 * a tie iff y - trunc(y) == 0.5 (exact in f32) -- the same quantities the portable kernel rounds
 * with. f32 subnormals never tie and convert to +-0 in both (also under DAZ). Overflow is the
 * hardware's: >= 65520 goes to infinity exactly like the reference's carry into exponent 31.
 * NaNs are replaced by the quiet NaN 0x7FC00000 with their sign before the conversion, so they
 * come out as 0x7E00 | sign, the reference's canonical NaN, whatever their payload.
 *
 * f16 decode: vcvtph2ps is exact for every half that is not a NaN (subnormal halves become normal
 * floats, so FTZ/DAZ do not apply). NaN lanes are rebuilt as the portable kernel does (sign,
 * exponent 255, payload << 13) so signalling NaNs keep their bits.
 *
 * q8 encode: the row maximum as the portable loop (max over |x|'s bits, NaN as 0) with 32-bit
 * integer max; the scale is the same scalar expression; vdivps is IEEE division, correctly
 * rounded like divss, so every quotient is bit-identical; the rounding is skippy_q8_round lane by
 * lane in integer ops (NaN -> 0, clamp at 127.5, trunc + exact fraction >= 0.5, clamp at 127, sign
 * restored), then vpackssdw/vpacksswb (values already in [-127, 127], so no saturation) and a
 * lane permute to restore element order.
 */
#ifndef SKIPPY_ACTIVATION_X86_H
#define SKIPPY_ACTIVATION_X86_H

#if !defined(SKIPPY_NO_X86_KERNELS) && defined(__x86_64__) \
    && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 5))
#define SKIPPY_HAVE_X86_KERNELS 1

#include <immintrin.h>

#define SKIPPY_X86_TARGET __attribute__((target("avx2,f16c"), noinline))
#define SKIPPY_X86_INLINE __attribute__((target("avx2,f16c"), always_inline))

static int skippy_x86_kernels_supported(void) {
    __builtin_cpu_init();
    /* libgcc / compiler-rt clear the AVX features when XGETBV says the OS does not save YMM. */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

SKIPPY_X86_TARGET
static void skippy_encode_f16_avx2(const uint32_t *source, unsigned char *target,
                                   Py_ssize_t count) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i sign_mask = _mm256_set1_epi32((int32_t)0x80000000u);
    const __m256i low_mask = _mm256_set1_epi32(0x1FFF);
    const __m256i tie_bits = _mm256_set1_epi32(0x1000);
    const __m256i min_normal = _mm256_set1_epi32(0x38800000);  /* 2^-14 */
    const __m256i infinity = _mm256_set1_epi32(0x7F800000);
    const __m256i quiet_nan = _mm256_set1_epi32(0x7FC00000);
    const __m256 scale = _mm256_set1_ps(16777216.0f);  /* 2^24 */
    const __m256 half = _mm256_set1_ps(0.5f);
    Py_ssize_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(source + i));
        __m256i magnitude = _mm256_and_si256(bits, abs_mask);
        __m256i normal_tie = _mm256_cmpeq_epi32(_mm256_and_si256(bits, low_mask), tie_bits);
        __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_min_epi32(magnitude, min_normal)),
                                 scale);
        __m256 fraction = _mm256_sub_ps(
            y, _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
        __m256i subnormal_tie = _mm256_castps_si256(_mm256_cmp_ps(fraction, half, _CMP_EQ_OQ));
        __m256i subnormal = _mm256_cmpgt_epi32(min_normal, magnitude);
        __m256i tie = _mm256_blendv_epi8(normal_tie, subnormal_tie, subnormal);
        bits = _mm256_sub_epi32(bits, tie);  /* +1 on ties */
        __m256i nan = _mm256_cmpgt_epi32(magnitude, infinity);
        bits = _mm256_blendv_epi8(
            bits, _mm256_or_si256(_mm256_and_si256(bits, sign_mask), quiet_nan), nan);
        __m128i halves = _mm256_cvtps_ph(_mm256_castsi256_ps(bits),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(target + 2 * i), halves);
    }
    for (; i < count; i++) {
        skippy_store_u16(target + 2 * i, skippy_f32_bits_to_f16(source[i]));
    }
}

SKIPPY_X86_TARGET
static void skippy_decode_f16_avx2(const unsigned char *source, uint32_t *target,
                                   Py_ssize_t count) {
    const __m256i magnitude_mask = _mm256_set1_epi32(0x7FFF);
    const __m256i sign_mask = _mm256_set1_epi32(0x8000);
    const __m256i payload_mask = _mm256_set1_epi32(0x3FF);
    const __m256i infinity = _mm256_set1_epi32(0x7C00);
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    Py_ssize_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m128i halves = _mm_loadu_si128((const __m128i *)(source + 2 * i));
        __m256i value = _mm256_castps_si256(_mm256_cvtph_ps(halves));
        __m256i wide = _mm256_cvtepu16_epi32(halves);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(wide, magnitude_mask), infinity);
        __m256i nan_bits = _mm256_or_si256(
            _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(wide, sign_mask), 16), exponent),
            _mm256_slli_epi32(_mm256_and_si256(wide, payload_mask), 13));
        value = _mm256_blendv_epi8(value, nan_bits, nan);
        _mm256_storeu_si256((__m256i *)(target + i), value);
    }
    for (; i < count; i++) {
        target[i] = skippy_f16_to_f32_bits(skippy_load_u16(source + 2 * i));
    }
}

/* skippy_q8_round on eight quotients, as int32 lanes. */
SKIPPY_X86_INLINE
static inline __m256i skippy_q8_round_avx2(__m256 quotient) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i infinity = _mm256_set1_epi32(0x7F800000);
    const __m256i limit = _mm256_set1_epi32(0x42FF0000);  /* 127.5f */
    const __m256i below_half = _mm256_set1_epi32(0x3EFFFFFF);
    const __m256i max_q = _mm256_set1_epi32(127);
    __m256i bits = _mm256_castps_si256(quotient);
    __m256i negative = _mm256_srai_epi32(bits, 31);
    __m256i magnitude = _mm256_and_si256(bits, abs_mask);
    magnitude = _mm256_andnot_si256(_mm256_cmpgt_epi32(magnitude, infinity), magnitude);
    magnitude = _mm256_min_epi32(magnitude, limit);
    __m256 y = _mm256_castsi256_ps(magnitude);
    __m256i truncated = _mm256_cvttps_epi32(y);
    __m256i fraction = _mm256_castps_si256(_mm256_sub_ps(y, _mm256_cvtepi32_ps(truncated)));
    __m256i rounded = _mm256_sub_epi32(truncated, _mm256_cmpgt_epi32(fraction, below_half));
    rounded = _mm256_min_epi32(rounded, max_q);
    return _mm256_sub_epi32(_mm256_xor_si256(rounded, negative), negative);
}

SKIPPY_X86_TARGET
static void skippy_encode_q8_avx2(const float *source, unsigned char *target, Py_ssize_t rows,
                                  Py_ssize_t width) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i infinity = _mm256_set1_epi32(0x7F800000);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int8_t *quantized = (int8_t *)(target + 4 * rows);
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *values = source + row * width;
        __m256i maximum = _mm256_setzero_si256();
        Py_ssize_t column = 0;
        for (; column + 8 <= width; column += 8) {
            __m256i bits = _mm256_and_si256(
                _mm256_loadu_si256((const __m256i *)(values + column)), abs_mask);
            bits = _mm256_andnot_si256(_mm256_cmpgt_epi32(bits, infinity), bits);
            maximum = _mm256_max_epi32(maximum, bits);
        }
        __m128i folded = _mm_max_epi32(_mm256_castsi256_si128(maximum),
                                       _mm256_extracti128_si256(maximum, 1));
        folded = _mm_max_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(1, 0, 3, 2)));
        folded = _mm_max_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(2, 3, 0, 1)));
        int32_t max_bits = _mm_cvtsi128_si32(folded);
        for (; column < width; column++) {
            int32_t bits = skippy_float_bits(values[column]) & 0x7FFFFFFF;
            bits = bits > 0x7F800000 ? 0 : bits;
            max_bits = bits > max_bits ? bits : max_bits;
        }
        float scale = max_bits == 0 ? 1.0f : skippy_bits_float(max_bits) / 127.0f;
        skippy_store_f32(target + 4 * row, scale);
        int8_t *out = quantized + row * width;
        const __m256 divisor = _mm256_set1_ps(scale);
        column = 0;
        for (; column + 32 <= width; column += 32) {
            __m256i a = skippy_q8_round_avx2(
                _mm256_div_ps(_mm256_loadu_ps(values + column), divisor));
            __m256i b = skippy_q8_round_avx2(
                _mm256_div_ps(_mm256_loadu_ps(values + column + 8), divisor));
            __m256i c = skippy_q8_round_avx2(
                _mm256_div_ps(_mm256_loadu_ps(values + column + 16), divisor));
            __m256i d = skippy_q8_round_avx2(
                _mm256_div_ps(_mm256_loadu_ps(values + column + 24), divisor));
            /* packs work per 128-bit lane: bytes come out as dwords 0,4,1,5,2,6,3,7 of the
             * wanted order, which the permute undoes. */
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b),
                                                _mm256_packs_epi32(c, d));
            packed = _mm256_permutevar8x32_epi32(packed, order);
            _mm256_storeu_si256((__m256i *)(out + column), packed);
        }
        for (; column < width; column++) {
            out[column] = skippy_q8_round(values[column] / scale);
        }
    }
}

#endif /* x86-64 with gcc or clang */
#endif /* SKIPPY_ACTIVATION_X86_H */
