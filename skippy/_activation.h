/* Activation kernels of skippy/_wire.pyx, in C so that the compiler sees plain branch-free
 * loops it can vectorise (Cython lowers conditional expressions to if/else blocks).
 *
 * q8 (protocol.md §4.2): [rows x f32 scale][rows x width x i8], scale = max|x| / 127 (1.0 for an
 * all-zero row), q = clamp(round_half_away(x / scale), -127, 127), NaN quotients become 0 (as
 * Rust's saturating cast). The row maximum is taken over the bit patterns of |x| -- the same order
 * as the values for non-NaN floats -- with NaNs counted as 0, which is f32::max's NaN rule.
 * Rounding is truncation plus a correction from the exact fraction, which equals roundf.
 */
#ifndef SKIPPY_ACTIVATION_H
#define SKIPPY_ACTIVATION_H

#include <stdint.h>
#include <string.h>
#include "_byteorder.h"

static inline void skippy_encode_q8(const float *source, unsigned char *target,
                                    Py_ssize_t rows, Py_ssize_t width) {
    int8_t *quantized = (int8_t *)(target + 4 * rows);
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *values = source + row * width;
        uint32_t max_bits = 0;
        for (Py_ssize_t column = 0; column < width; column++) {
            uint32_t bits;
            memcpy(&bits, values + column, 4);
            bits &= 0x7FFFFFFFu;
            bits = bits > 0x7F800000u ? 0u : bits;
            max_bits = bits > max_bits ? bits : max_bits;
        }
        float max_abs;
        memcpy(&max_abs, &max_bits, 4);
        float scale = max_bits == 0u ? 1.0f : max_abs / 127.0f;
        skippy_store_f32(target + 4 * row, scale);
        int8_t *out = quantized + row * width;
        for (Py_ssize_t column = 0; column < width; column++) {
            float quotient = values[column] / scale;
            int32_t is_number = quotient == quotient;
            quotient = is_number ? quotient : 0.0f;
            quotient = quotient > 127.5f ? 127.5f : quotient;
            quotient = quotient < -127.5f ? -127.5f : quotient;
            int32_t truncated = (int32_t)quotient;
            float fraction = quotient - (float)truncated;
            truncated += (fraction >= 0.5f) - (fraction <= -0.5f);
            truncated = truncated > 127 ? 127 : truncated;
            truncated = truncated < -127 ? -127 : truncated;
            out[column] = (int8_t)truncated;
        }
    }
}

#endif /* SKIPPY_ACTIVATION_H */
