/* The decode relay's greedy pick (skippy/stage/_relay.pyx): numpy's argmax of one row of logits.
 *
 * numpy's argmax returns the first maximum, or the first NaN when there is one.  The relay
 * needs exactly that pick (it must answer what StageContext.sample answers) and needs it fast:
 * Gemma 3's vocabulary is 262144 logits a token.  So: one SSE2 pass for the maximum and for
 * whether a NaN is there at all, then the first index holding it, four lanes at a time.  A row
 * with a NaN (never, from a sane model) takes a plain scan for the first one.
 */
#ifndef SKIPPY_RELAY_PICK_H
#define SKIPPY_RELAY_PICK_H

#include <stdint.h>
#include <math.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static int32_t skippy_first_maximum(const float *values, int32_t count) {
    int32_t index = 0;
    float top = -INFINITY;
    int unordered = 0;
#if defined(__SSE2__)
    /* four independent accumulators: one max per cycle instead of one per max latency */
    __m128 tops[4], nans[4];
    for (int k = 0; k < 4; ++k) {
        tops[k] = _mm_set1_ps(-INFINITY);
        nans[k] = _mm_setzero_ps();
    }
    for (; index + 16 <= count; index += 16) {
        for (int k = 0; k < 4; ++k) {
            __m128 lane = _mm_loadu_ps(values + index + 4 * k);
            nans[k] = _mm_or_ps(nans[k], _mm_cmpunord_ps(lane, lane));
            tops[k] = _mm_max_ps(tops[k], lane);
        }
    }
    for (; index + 4 <= count; index += 4) {
        __m128 lane = _mm_loadu_ps(values + index);
        nans[0] = _mm_or_ps(nans[0], _mm_cmpunord_ps(lane, lane));
        tops[0] = _mm_max_ps(tops[0], lane);
    }
    __m128 all_tops = _mm_max_ps(_mm_max_ps(tops[0], tops[1]), _mm_max_ps(tops[2], tops[3]));
    __m128 any_nan = _mm_or_ps(_mm_or_ps(nans[0], nans[1]), _mm_or_ps(nans[2], nans[3]));
    unordered = _mm_movemask_ps(any_nan) != 0;
    __m128 tops_value = all_tops;
    float lanes[4];
    _mm_storeu_ps(lanes, tops_value);
    for (int lane = 0; lane < 4; ++lane) {
        top = lanes[lane] > top ? lanes[lane] : top;
    }
#endif
    for (; index < count; ++index) {
        float value = values[index];
        unordered |= value != value;
        top = value > top ? value : top;
    }
    if (unordered) {
        for (index = 0; index < count; ++index) {
            if (values[index] != values[index]) {
                return index;
            }
        }
    }
    index = 0;
#if defined(__SSE2__)
    __m128 wanted = _mm_set1_ps(top);
    for (; index + 4 <= count; index += 4) {
        int hits = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(values + index), wanted));
        if (hits) {
            return index + __builtin_ctz((unsigned) hits);
        }
    }
#endif
    for (; index < count; ++index) {
        if (values[index] == top) {
            return index;
        }
    }
    return 0;
}

#endif
