/* arch_gemma3.c - what gemma3 adds to the layer skeleton of forward.c.
 *
 * The rest of gemma3 is data, set up by model_load.c: embeddings scaled by
 * sqrt(n_embd); local layers (il % 6 < 5) attend over a sliding window with
 * their own rope base and no rope scaling (cache kind ROT, K/V kept in the
 * paged pool for all positions, masked by the window), global layers over
 * everything with the file's rope; per-head q/k norms; sandwich norms after
 * attention and after the FFN; GeGLU FFN (here).
 *
 * GELU: llama.cpp's CPU backend evaluates GELU through a table indexed by the
 * fp16 bits of the input, holding the f32 tanh-GELU of that fp16 value
 * rounded to fp16 (|x| >= 10: 0 or x exactly). We compute the same function
 * directly, without the table. With an exact f32 GELU the fixtures' logits
 * differ from llama.cpp's by 5e-3; with this, by 2.1e-3, spread as isolated
 * spikes where an activation lands on the other side of an fp16 rounding
 * boundary - the same effect that makes llama.cpp's own batched and
 * one-token evaluations of these files differ by 2.2e-3 (sidecar
 * batch_check). */
#include <math.h>

#include "model/model_internal.h"
#include "tensor/quant.h"

static float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f, coef_a = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef_a * x * x)));
}

void gemma3_geglu(float *y, const float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        float x = gate[i], g;
        if (x <= -10.0f) g = 0.0f;
        else if (x >= 10.0f) g = x;
        else g = quant_f16_to_f32(quant_f32_to_f16(gelu_tanh(quant_f16_to_f32(quant_f32_to_f16(x)))));
        y[i] = g * up[i];
    }
}
