/*
 * Quantization of one head: fit scales, compute codes, pack them into the
 * block of kernels/format.h, and the reverse. These are the C reference of
 * every storage method (kernels/format.h gives the formats); the CUDA kernels must produce
 * the same codes from the same fp32 tile.
 *
 * The arithmetic, spelled out so that other implementations can match it
 * (all float unless said otherwise; rint = round half to even; scales pass
 * through stepq__scale_to_fp16 and are used as the float of that fp16):
 *
 *   qmax_i = 2^(b_i - 1) - 1,  m_i = max_j |x_ij|   (rows with b_i = 16 are
 *   pivots: fp16 values, excluded from every scale below)
 *
 *   uniform, temporal (row absmax):
 *     r_i = fp16(m_i);  z_ij = clamp(rint((x_ij / r_i) * qmax_i), +-qmax_i)
 *     x^_ij = r_i * ((float)z_ij / (float)qmax_i)
 *
 *   dsq (w_i = 1), spatial, stepq (key-row-aware dual-axis fit), with the
 *   row split alpha of the head layout (the map's row_split, 0.5 by default;
 *   stepq__quant_row_split_of below):
 *     1. r_i = fp16(sqrtf(m_i / w_i))                          at alpha = 0.5,
 *        r_i = fp16((float)(pow(m_i, alpha) / sqrt(w_i)))       otherwise
 *        (pow and sqrt in double)
 *     2. y_ij = x_ij / r_i;  c_j = fp16(max_i |y_ij|)
 *     3. z_ij = clamp(rint((y_ij / c_j) * qmax_i), +-qmax_i)
 *     4. fixed-code column refit (double accumulation over rows in order):
 *          zt = (float)z_ij / (float)qmax_i
 *          num_j = sum_i w_i^2 r_i zt x_ij,  den_j = sum_i w_i^2 r_i^2 zt^2
 *          c_j = den_j > 0 ? fp16(num_j / den_j) : c_j (step 2)
 *     x^_ij = (r_i * c_j) * ((float)z_ij / (float)qmax_i)
 *
 *   The decode fit "norefit" (the map's decode_fit, hl->decode_fit; a decode
 *   step's new state only: stepq__quantize_head_fit below) is steps 1-3
 *   without step 4: no num_j / den_j, and the stored column scale is step
 *   2's c_j = fp16(max_i |y_ij|) over the integer rows, the scale the codes
 *   were rounded with (so a column of all-zero codes keeps it, as the exact
 *   fit's den_j = 0 does). Row scales, codes, pivot rows and the block
 *   format are the exact fit's; a head without integer rows stores column
 *   scales 0 either way. Packs and calibration always fit exactly.
 *
 *   The decode fit "rows" (decode_fit "rows"; a decode step's new state
 *   only) keeps the column scales c_j of the OLD block (the one the step
 *   decoded, the float of its fp16) and refits only the row scales; the
 *   row impact w and the row split are not used (they only balance the two
 *   axes of the exact fit). Pivot rows are stored as always:
 *     rc_j = RN(1 / c_j)                                  (once per column)
 *     1. m_i = max_j |x_ij| * rc_j;  r_i = fp16(m_i)  (the same conversion;
 *        never 0: it clamps to [2^-14, 65504])
 *     2. s_i = qmax_i / r_i            (one float division per row, RN)
 *        z_ij = clamp(rint((x_ij * rc_j) * s_i), +-qmax_i)
 *     3. the column scales are written back unchanged
 *     x^_ij = (r_i * c_j) * ((float)z_ij / (float)qmax_i)
 *   The whole head is fitted exactly instead (in the same call: the block
 *   is always valid) where the old block cannot serve: a c_j that is not a
 *   positive finite fp16 (0 included: a fresh zero page, or a head whose
 *   last fit had no integer rows; a column of a fit never holds anything
 *   else), a head without integer rows, an m_i > 65504 (r_i would
 *   saturate), or the growth trigger: an integer row whose m_i exceeds
 *   STEPQ__ROWS_GROW (1.5, kernels/format.h) times the float of its OLD
 *   fp16 row scale, compared in float as m_i > 1.5f * r_i_old (a column
 *   that outgrew its stale scale shows up as a jump of the rows it
 *   dominates; an old row scale 0 is a fresh page, which the column rule
 *   already sends there). Non-finite elements of x are zeroed first (health STATE),
 *   as for every fit, and do not decide it: in a decode step the update
 *   has zeroed them before the fit (kernels/recurrence.c), and the CUDA
 *   kernels zero them before theirs (in the tile kernel's non-finite
 *   check; two-stage stage 2 only ever sees stage 1's zeroed scratch), so
 *   every path decides on the same sanitised state. The CUDA kernels take
 *   the same decisions (kernels/cuda/README.md). The
 *   column scales are those of the last exact fit (the pack, or a
 *   fallback): they drift from the state's columns as decoding goes on.
 *
 *   fp8 (kernels/format.h): per tile t of 32 columns over all rows,
 *     s_t = m_t / 240 (m_t = max |x| of the tile, stored as fp32, not clamped)
 *     c_ij = e4m3_rne(clamp(x_ij / s_t, +-240)) (s_t = 0: c_ij = 0)
 *     x^_ij = float(c_ij) * s_t
 *
 * The refit changes c_j but not the codes (they were chosen with the step-2
 * scales), so a decoder needs nothing but the stored codes and scales.
 */
#ifndef STEPQ_KERNELS_QUANT_H
#define STEPQ_KERNELS_QUANT_H

#include <stdint.h>

#include "kernels/format.h"
#include "plugin/vocab.h" /* stepq__method_uses_row_impact */

/**
 * Fits and packs one head.
 *
 * @param hl    the head's layout (stepq__head_layout_init).
 * @param x     the state, fp32 [d_k][d_v] row-major; not modified.
 *              Non-finite elements are treated as 0 (flag STEPQ_HEALTH_STATE).
 * @param w     d_k row-impact factors (finite, > 0) for spatial/stepq, or
 *              NULL for all 1; ignored by the other methods.
 * @param block hl->block_bytes bytes, fully overwritten (padding and unused
 *              scale slots are written as 0, so equal inputs give equal bytes).
 * @param flags OR-ed with STEPQ_HEALTH_STATE / STEPQ_HEALTH_SATURATED; may be NULL.
 * @return STEPQ_OK; STEPQ_EINVAL for a bad layout or w (block untouched);
 *         STEPQ_ENOMEM (block untouched).
 * Thread-safety: reentrant.
 */
int stepq__quantize_head(const struct stepq__head_layout *hl, const float *x, const float *w,
                         void *block, uint32_t *flags);

/**
 * stepq__quantize_head with the dual-axis fit `fit` (the other methods
 * ignore it): STEPQ_DECODE_FIT_EXACT is stepq__quantize_head,
 * STEPQ_DECODE_FIT_NOREFIT skips step 4, STEPQ_DECODE_FIT_ROWS keeps the
 * column scales of `old` (above). The decode step of the C reference
 * (kernels/step.c) passes its head layout's decode_fit and the block it
 * decoded; packs and calibration call stepq__quantize_head.
 *
 * @param old   the old block (hl's layout) whose column scales the fit rows
 *              keeps; may be `block` itself (read before it is written);
 *              ignored (may be NULL) by the other fits and methods.
 * @return as stepq__quantize_head; STEPQ_EINVAL for a fit outside the list,
 *         or ROWS on a dual-axis head without `old` (block untouched).
 */
int stepq__quantize_head_fit(const struct stepq__head_layout *hl, const float *x, const float *w,
                             const void *old, void *block, uint32_t *flags, stepq_decode_fit fit);

/**
 * stepq__quantize_head_fit that also says which fit ran: *exact (may be NULL)
 * is set to 1 where a dual-axis head took the exact fit, under `fit` ROWS the
 * fallback (the old column scales could not serve: kernels/format.h's
 * conditions and the growth trigger), and to 0 otherwise. For analysis
 * (`stepq eval` reports the rows fit's fallback rate); the store is the same.
 */
int stepq__quantize_head_fit_ex(const struct stepq__head_layout *hl, const float *x, const float *w,
                                const void *old, void *block, uint32_t *flags, stepq_decode_fit fit,
                                int *exact);

/**
 * Reconstructs one head from its block into x, fp32 [d_k][d_v].
 * @return STEPQ_OK or STEPQ_EINVAL for a bad layout.
 */
int stepq__dequantize_head(const struct stepq__head_layout *hl, const void *block, float *x);

/**
 * The weighted squared error sum_i w_i^2 sum_j (x_ij - y_ij)^2 (w NULL = 1),
 * the objective the dual-axis fit minimises; used by tests and calibration.
 */
double stepq__weighted_sq_error(const float *x, const float *y, const float *w, int d_k, int d_v);

/*
 * The row split alpha of the dual-axis fit (dsq, spatial, stepq): row i is
 * divided by r_i = max_j |x_ij|^alpha / sqrt(w_i) before the column scales
 * are fitted (step 1 above). 0.5 is the paper's balanced split, which leaves
 * a row whose absmax is 1/100 of the head's largest using 1/10 of its code
 * range; 1.0 normalises every row to its own range first. A fit takes alpha
 * from its head layout (hl->row_split: the map field row_split, 0.5 unless
 * the map says otherwise) unless the process override below is set.
 */

/**
 * Sets the process-wide analysis override of the row split: while it is
 * set, every fit of the C reference uses alpha, whatever the head layout's
 * (the map's) row_split says. For `stepq eval --row-split` and the NLL shim
 * (`nll_eval.py --row-split`), to measure another split on maps calibrated
 * with theirs; a map that should keep a split carries it in row_split
 * instead (`stepq calibrate --row-split`). Unset by default. The CUDA
 * kernels do not see it (they fit with the head layout's split, which
 * their per-head descriptor carries), so a CUDA pool and a host pool agree
 * only while it is unset (or equal to the map's own split).
 *
 * @return STEPQ_OK, or STEPQ_EINVAL (setting unchanged) outside (0, 1].
 * Thread-safety: process-wide; set or clear it before any quantization starts.
 */
int stepq__quant_set_row_split(double alpha);
/** Clears the override: fits use their head layout's row split again. */
void stepq__quant_clear_row_split(void);
/** The override, or 0 when none is set. */
double stepq__quant_row_split(void);
/** The row split a fit with its own split `own` uses: the override when set, else own. */
double stepq__quant_row_split_or(double own);
/** The row split a fit of hl uses: stepq__quant_row_split_or(hl->row_split). */
double stepq__quant_row_split_of(const struct stepq__head_layout *hl);

/*
 * The arithmetic of the packed step, as an analysis override (issue #15's design
 * question: could the kernels' per-element work run in packed fp16?). While it is on,
 * every quantized integer method of the C reference (not fp8, not the dense methods)
 * passes the state through fp16 three times per store, each in the block's normalised
 * domain (divided by the smallest power of two >= a bound of its magnitudes, which is
 * exact, then rounded to fp16 and multiplied back, so fp16's range never binds): the
 * state to fit (the updated state) on entry to stepq__quantize_head_fit_ex, y = x / r_i
 * inside the fit (dual-axis and row-scale fits; not the decode fit rows), and the
 * reconstruction of stepq__dequantize_head (bound max r_i x max c_j, pivot rows by their
 * largest value). Scales, the quantize, the refit sums and everything outside stay fp32,
 * the update's k and u included (a half2 update x + k u would round them too; the replay's
 * fp32 reference runs the same update code, so they are left alone here).
 * For `stepq eval --arith fp16`; off by default. No kernel implements it, and the CUDA
 * kernels do not see it, so host and CUDA pools agree only while it is off.
 * Thread-safety: process-wide; set it before any quantization starts.
 */
/** Turns the fp16 arithmetic on (on != 0) or off; STEPQ_OK. */
int stepq__quant_set_arith_fp16(int on);
/** Whether it is on. */
int stepq__quant_arith_fp16(void);

/*
 * The fp16 arithmetic of the packed decode step (the map field arith = fp16; kernels/step_f16.c,
 * the C reference of kernels/cuda/f16_kernel.cuh). It applies to the heads of a dual-axis method
 * (stepq__step_f16_supports): on a GDN layer the integer heads whose rows share one width b
 * (pivot heads take the fp32 step), on a KDA layer every head with at least one integer row,
 * whatever its mix of widths and pivot rows (the KDA differences are listed after step 6). Bytes of
 * the block that no field covers (alignment padding) are written 0. Packs, unpacks and calibration
 * always use fp32.
 *
 * The block is the format's (kernels/format.h) either way: the arithmetic decides only which
 * codes and scales a decode step writes. Notation: h(x) = x rounded to fp16 (to nearest even,
 * subnormals kept), each half operation rounded once (the GPU's HMUL2 / HFMA2 / HSUB2 / HMNMX2);
 * other operations are correctly rounded fp32, left to right as written; P(x) = the smallest
 * power of two >= x (2^-126 for 0); rows fall into groups g of 8 (the kernel's thread tiles) and
 * blocks w of 16 (its warps: groups 2w and 2w + 1). Inputs as for the fp32 step (prepared q, k;
 * v, beta), alpha = (float)exp((double)g); r_i, c_j, z_ij the old block's scales and codes;
 * qmax = 2^(b-1) - 1, iq = RN(1 / qmax); w_i the row impact.
 *
 *   1. dots: Pk_g = P(max_{i in g} |r_i k_i|), wk_i = h(r_i k_i (1 / Pk_g)) (q likewise);
 *      ak_gj = the half sum over i in g, in order, of fma(z_ij, wk_i, .); a_j = (fp32)
 *      0 + (ak_0j Pk_0 + ak_1j Pk_1) + (ak_2j Pk_2 + ak_3j Pk_3) + ... (pairs, then in order);
 *      f_j = c_j alpha iq; s_j = a_j f_j, t_j = b_j f_j; u_j = beta (v_j - s_j);
 *      o_j = fma(u_j, k.q, t_j) (0 and OUTPUT when not finite).
 *   2. update: Pc = P(max_j c_j), Su = P(max_j |u_j|); C_j = h(c_j / Pc), U_j = h(u_j / Su);
 *      N_i = P(max(alpha r_i Pc, |k_i| max_j |u_j|)) (so |x_ij| / N_i <= 1),
 *      F_i = h(alpha r_i Pc iq / N_i), K_i = h(k_i Su / N_i);
 *      X_ij = h(fma(K_i, U_j, h(h(z_ij F_i) C_j))) = x_ij / N_i.
 *   3. rows: m_i = max_j |X_ij| N_i (exact); r'_i = the exact fit's row scale of m_i (sqrt(m_i /
 *      w_i), or the row split's formula; clamped as every stored scale); A_i = w_i w_i r'_i r'_i.
 *   4. Y: P_w = P(max_{i in w} m_i / r'_i), P = max_w P_w; R_i = h(min(N_i (1 / P_w) / r'_i,
 *      65504)); Y_ij = h(X_ij R_i) = x_ij / (r'_i P_w).
 *   5. columns: CM_j = max_w h(max_{i in w} |Y_ij| (P_w / P)); when some CM_j P > 65504 the
 *      block saturates (SATURATED; CM_j clamped to 65504 / P, the codes clamped below);
 *      Q_j = h(CM_j > 0 ? min(qmax / CM_j, 65504) : 0), per block Q_wj = h(Q_j (P_w / P)).
 *   6. codes: T_ij = h(fma(Y_ij, Q_wj, 1536 + qmax)) (clamped to 1536 + [0, 2 qmax] when the
 *      block saturates), z'_ij = T_ij - 1536 - qmax (exact; the stored u = z' + qmax is the low
 *      b bits of T's half); refit: Pa_g = P(max_{i in g} A_i) (times 4 at b = 8: 8 rows of
 *      A z^2 stay below 65504), A'_i = h(A_i / Pa_g); half sums over i in g, in order, of
 *      n: fma(h(z' Y), A'_i, .) and d: fma(h(z' z'), A'_i, .); n_j, d_j = the fp32 sums of 1.
 *      with the partials n_gj Pa_g (P_w / P) and d_gj Pa_g;
 *      c'_j = d_j > 0 ? qmax P n_j / d_j : CM_j P (clamped as every stored scale).
 *   KDA (per-row decays alpha_i = (float)exp((double)g_i), widths b_i, qmax_i, iq_i = RN(1 /
 *   qmax_i); pivot rows p with fp16 values x_pj, a non-finite one read as 0 with STATE):
 *   1. e_i = r_i alpha_i iq_i (0 for a pivot row); Pk_g, wk_i as above with e_i in place of
 *      r_i (q likewise), the half sums over the integer rows of g, a_j and b_j as above;
 *      s_j = a_j c_j, then for each pivot row p in row order s_j = fma(x_pj alpha_p, k_p, s_j)
 *      (t_j from b_j with q_p likewise; no f_j); u_j and o_j as above.
 *   2. integer rows as above with alpha_i r_i and iq_i; a pivot row is the fp32 step's
 *      (x_pj alpha_p + k_p u_j, each operation rounded; not finite: 0, STATE), stored as its
 *      fp16 saturating (SATURATED where clamped), and is in no maximum, scale or sum below
 *      (its row scale slot is 0).
 *   5. Q_j = h(CM_j > 0 ? min(1 / CM_j, 65504) : 0) (no qmax).
 *   6. G_ij = h(Y_ij Q_wj), T_ij = h(fma(G_ij, qmax_i, 1536 + qmax_i)) (clamped to 1536 +
 *      [0, 2 qmax_i]), z'_ij = T_ij - 1536 - qmax_i; the refit sums zt = h(z' h(iq_i)) for z'
 *      (no factor 4 at b = 8: zt^2 <= 1) and c'_j = d_j > 0 ? P n_j / d_j : CM_j P.
 *   The decode fit norefit (hl->decode_fit) skips the refit: no A_i, Pa_g, n or d, and
 *   c'_j = CM_j P, the scale the codes were rounded with (clamped as every stored scale), as the
 *   fp32 step's norefit stores its step-2 c_j. Codes and row scales are the exact fit's.
 *
 * The state passes through fp16 in the normalised domains only (|X|, |Y| <= 1 but for rounding),
 * so fp16's range does not bind but for columns more than 2^14 below the largest of their block
 * (subnormal) and rows whose new maximum is 2^-16 of their bound N_i (R_i saturates).
 */
/**
 * A scale as a fit stores it: *h = stepq__scale_to_fp16(s), STEPQ_HEALTH_SATURATED raised in
 * *flags where s > 65504; returns the float of *h (the value the fit then divides by).
 */
float stepq__scale_value(float s, uint16_t *h, uint32_t *flags);

/** Whether head layout hl takes the fp16 step: column scales, and GDN integer rows of one width
 * or KDA rows of any widths and pivots with at least one integer row. */
int stepq__step_f16_supports(const struct stepq__head_layout *hl);
/**
 * One head's fp16 decode step: block in -> block out (may be the same), readout o[d_v], the
 * health flags raised (SATURATED, OUTPUT; STATE for KDA pivot rows). q, k, v, beta prepared as
 * for the fp32 step (q scaled), g the log decay (GDN: g[0]; KDA: d_k of them), w the row impact
 * (NULL = 1). scratch: 2 d_k d_v floats. targ, if not NULL, gets each code's argument Y_ij Q_wj
 * before rounding (the tie checks of the tests). The layout must pass stepq__step_f16_supports.
 */
uint32_t stepq__step_head_f16(const struct stepq__head_layout *hl, const uint8_t *in,
                              const float *w, const float *q, const float *k, const float *v,
                              const float *g, float beta, uint8_t *out, float *o, float *scratch,
                              float *targ);

#endif /* STEPQ_KERNELS_QUANT_H */
