"""Every numeric tolerance of the engine tests, in one place (all runs are float32).

HOOK_*    block output after our hook vs (raw output + delta computed in the test):
          one float32 add against a float64 delta rounded once; ~1 ulp of |h|+|delta|.
ENCODE_*  monitored activations vs an independent float64 encode of the same residual:
          a float32 matmul over d_in=64 terms (error ~ sqrt(64)·eps·|x||w|).
LOGPROB_* engine logprobs vs log_softmax of the test's own forward.
EMBED_*   pooled hidden states vs the test's own pooling.
POSITIVE_CONTROL_MIN  a steer must move the block output at least this much (max-abs),
          or a test that expects a change would pass vacuously.
SAELENS_* our encode / steering rows vs SAELens's own classes on the same file, both
          float32 (d_in=16): the same formulas up to operation order (a gated SAE's
          magnitude scale is applied after the shared matmul, not to a second W_enc;
          folded weights are folded in the same order), so a few ulp of values <= ~10.
BATCH_*   a request run inside a continuous batch vs the same request run alone (both
          float32, same code): only the matmul/attention blocking changes with the
          batch's shape (rows, left padding), so values differ by a few ulp; measured
          ≤ 2.4e-6 on activations of magnitude ≤ 10 and ≤ 2.1e-6 on logprobs across the
          three tiny models, so 2e-5 leaves ~10× headroom.  Tokens must be identical.
CAPTURE_* captured block outputs vs the test's own float32 forward of a second copy of
          the model over the whole sequence (unpacked weights, no KV cache): the same
          formulas with another matmul blocking, a few ulp of values of magnitude <= ~10.
LLAMACPP_CAPTURE_* the llama.cpp backend's captured block outputs and rotated Q/K vs the
          same float32 references from the checkpoint the GGUF was converted from:
          llama.cpp's own float32 kernels (another summation order and its own rope),
          measured ≤ 3e-6 on values of magnitude ≤ ~10 (the residuals the llama.cpp
          monitoring tests compare, ≤ 1e-5), so CAPTURE_*'s bound holds with headroom.
ANALYSIS_* an analyzer's result on a captured (float32) artifact vs the test's own float64
          formula on that reference forward: CAPTURE_* per value, summed over up to 64
          terms (a probe's dot product, a norm) or a softmax over the prompt, so ~10x.
PROBE_*   a probe's score on /v1 vs the test's own float64 score of an independent
          encode (or hidden state) of the reference forward: ENCODE_* (or CAPTURE_*) per
          value times weights of magnitude <= 1 summed over <= 64 terms.
QUANTIZED_* a Q8 load (int8 weights, bfloat16 activations into its matmuls) against the
          float32 load of tiny-llama, teacher-forced over float32's own greedy
          continuations: the share of positions where both pick the same next token.
          The tiny models' random weights give near-tied logits, so one changed rounding
          can flip a pick; measured 47/48 on this machine; free-running greedy
          kept 2 of 3 prompts identical for 24 tokens and parted at the first token of
          the third.  SmolLM2-135M: see docs/engine.md.
PARITY_ACT_* the demo SmolLM2-135M's monitored SAE activations (layer 12) on vLLM and
          llama.cpp vs the transformers backend, all float32 on the same weights
          (test_backend_parity.py): three kernel sets (their own matmul blocking,
          attention, RMSNorm and rope summation orders) over 12 layers of a 576-wide
          residual, each layer's rounding carried into the next, then the SAE's 576-term
          encode; the first token's row reads activations of ~700.  Measured over every
          monitored value of the test's batch: ≤ 2.2e-6 absolute where |value| ≤ 1, and
          ≤ 3.9e-6 (vLLM) / 1.4e-5 (llama.cpp) relative above it, so |got − want| ≤
          2e-5 + 1e-4·|want| leaves ≥ 7× headroom.  Tokens must be identical.
DISTRIBUTION_* a generation's teacher-forced distributions (the full float32 log-softmax
          of prompt rows) vs the test's own float64 forward of the checkpoint and its own
          log_softmax (test_distributions.py): float32 rounding through the tiny models'
          layers and a log-sum-exp over the vocabulary, measured ≤ 2.3e-6 on log-
          probabilities of magnitude ≤ ~10 (steered rows included), ≤ 1.9e-6 on llama.cpp
          (its own float32 kernels, serial and batched, control vector and callback):
          1e-5 leaves ≥ 4× headroom on both.
ATTRIBUTION_* an attribution's activation × gradient (float32, the engine's one backward
          pass) vs ``f_i`` times the test's own central difference of the target logit in a
          float64 copy of the checkpoint (test_attribution.py), Richardson-combined at steps
          ATTRIBUTION_FD_STEP and half of it along W_dec[i]: the tiny models' RMSNorms cast
          to float32 even in a float64 model, so a small step measures their rounding (at
          1e-4 the difference was off by 5e-3) and a large one the curvature; at 0.25 the
          two terms meet. Measured over every non-zero value of the five cases: ≤ 9e-6 on
          values of magnitude ≤ ~1, so 5e-5 leaves > 5× headroom. The ablation check
          (a float32 forward with the feature zeroed, minus the clean one) vs the test's
          own float64 pair: ≤ 2.3e-6 measured, 2e-5 allowed.
"""

HOOK_ATOL = 2e-5
HOOK_RTOL = 1e-5
ENCODE_ATOL = 2e-4
ENCODE_RTOL = 1e-4
LOGPROB_ATOL = 1e-5
EMBED_ATOL = 1e-5
POSITIVE_CONTROL_MIN = 0.5
SAELENS_ATOL = 1e-5
SAELENS_RTOL = 1e-5
BATCH_ENCODE_ATOL = 2e-5
BATCH_ENCODE_RTOL = 1e-5
BATCH_LOGPROB_ATOL = 2e-5
CAPTURE_ATOL = 2e-5
CAPTURE_RTOL = 1e-5
LLAMACPP_CAPTURE_ATOL = 2e-5
LLAMACPP_CAPTURE_RTOL = 1e-5
ANALYSIS_ATOL = 2e-4
ANALYSIS_RTOL = 1e-4
PROBE_ATOL = 2e-3
QUANTIZED_GREEDY_AGREEMENT_MIN = 0.9
PARITY_ACT_ATOL = 2e-5
PARITY_ACT_RTOL = 1e-4
DISTRIBUTION_ATOL = 1e-5
ATTRIBUTION_ATOL = 5e-5
ATTRIBUTION_RTOL = 1e-4
ATTRIBUTION_FD_STEP = 0.25
ATTRIBUTION_ABLATION_ATOL = 2e-5
