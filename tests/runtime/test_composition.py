"""The composition matrix: the parallel axes combined, each run equal to the serial model (float64, 2 AdamW steps
with clipping and weight decay; the loss of every step, every gathered gradient of every step, the weights after
the steps and a validation loss after them, relative error ≤ 1e-9).

`MATRIX` is the table of runs. `test_the_matrix_covers_every_pair_of_axes` derives from each row what it
combines and fails if a pair of axes (dp·tp, dp·pp, …, cp·ep), an axis with a ZeRO stage or a recomputation mode,
sequence parallelism with an axis, or a pipeline schedule or context-parallel variant with an axis goes missing;
`test_the_matrix_has_the_three_axis_layouts` does the same for the issue's 8-rank layouts — so dropping a row
that is the only witness of something fails. `DEVICE_MATRIX` runs pipelines on device arrays (the CuPy double).

One launch per rank count runs all of that count's rows in turn (starting ranks is the slow part); the models
are tiny (4 layers so that pp·V = 4 chunks fit, 16 channels, 4 heads, 16 positions). No combination of axes
is refused on purpose; `REFUSED` lists layouts whose sizes do not fit together, each with its one clear error.
"""

from __future__ import annotations

import itertools
import os

import pytest
from mpi_harness import run_on_ranks, train_error
from workers import composition_checks

from models.transformer import parameter_shapes
from mpiparallel.train import TrainSettings
from mpiparallel.train.inputs import model_config

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)

DENSE = {"n_layer": 4, "n_head": 4, "n_embd": 16, "seq_len": 16, "batch_size": 8, "steps": 2, "dtype": "float64",
         "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 256, "lr": 1e-2,
         "eval_every": 2, "eval_batches": 1,  # one validation batch after the last step: the forward-only path
         "bucket_mb": 0.004}  # 4 KB: about a bucket per unit, so ZeRO's shards and gathers cross bucket boundaries
# aux loss off: the serial run's token sets (one per microbatch) differ from a parallel run's (see DESIGN.md)
MOE = {**DENSE, "experts": 4, "top_k": 2, "moe_aux_coef": 0.0}
# aux-loss-free balancing instead: expert biases moved after every step from the global batch's counts
MOE_BIAS = {**MOE, "top_k": 1, "moe_bias_rate": 0.01}
# the llama family: grouped-query attention (2 KV heads for 4 query heads), RoPE, RMSNorm, SwiGLU, untied head;
# multi-query (1 KV head, so tp 2 replicates it) with a tied head; Mixtral experts
LLAMA = {**DENSE, "arch": "llama", "n_kv_head": 2, "ffn_hidden": 24}
LLAMA_MQA = {**LLAMA, "n_kv_head": 1, "tie_embeddings": True}
MIXTRAL = {**LLAMA, "experts": 4, "top_k": 2, "moe_aux_coef": 0.0}
# DeepSeek-V3: latent attention with a low-rank query (q 4+4 wide, v 3 per head, latent 8), a dense first block,
# then DeepSeekMoE with group-limited routing and a shared expert; and one query projection with the selection
# bias moved by aux-loss-free balancing
DEEPSEEK = {**DENSE, "arch": "deepseek_v3", "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4, "v_head_dim": 3, "ffn_hidden": 24, "experts": 4, "top_k": 2, "moe_ffn_hidden": 6,
            "n_group": 2, "topk_group": 1, "first_k_dense": 1, "routed_scaling_factor": 2.0}
DEEPSEEK_BIAS = {**{key: value for key, value in DEEPSEEK.items() if key != "q_lora_rank"}, "top_k": 2,
                 "n_group": 1, "topk_group": 1, "moe_bias_rate": 0.01}
# two multi-token-prediction modules, and the sequence-wise balance loss (equal to serial where sequences stay whole)
DEEPSEEK_MTP = {**DEEPSEEK, "mtp_depth": 2, "mtp_weight": 0.3, "moe_seq_aux_coef": 0.05}
# the two modules where the sequence is split (SP, CP: the balance loss, which needs whole sequences, is off)
DEEPSEEK_MTP_SPLIT = {**DEEPSEEK, "mtp_depth": 2, "mtp_weight": 0.3}
# packed documents (--attention document): the byte corpus's spaces open documents, so each 16-byte window holds
# about three words, every token attending within its own and positions restarting at each
# DeepSeek-V3's sequence-wise balance loss where CP (every variant) and SP split the sequences: each rank's share,
# its expert counts summed over the ranks holding the sequence
DEEPSEEK_SEQUENCE = {**DEEPSEEK, "moe_seq_aux_coef": 0.05}
# the Switch aux loss over the whole step (--moe-aux-scope global): on any mesh the serial model's value and gradient
MOE_GLOBAL = {**MOE, "moe_aux_coef": 0.05, "moe_aux_scope": "global"}
MIXTRAL_GLOBAL = {**MIXTRAL, "moe_aux_coef": 0.05, "moe_aux_scope": "global"}
DOCUMENTS = {"attention": "document", "eot_id": ord(" ")}
DENSE_DOC, LLAMA_DOC = {**DENSE, **DOCUMENTS}, {**LLAMA, **DOCUMENTS}
MIXTRAL_DOC, DEEPSEEK_DOC = {**MIXTRAL, **DOCUMENTS}, {**DEEPSEEK, **DOCUMENTS}
MODELS = {"dense": DENSE, "moe": MOE, "moe-bias": MOE_BIAS, "llama": LLAMA, "llama-mqa": LLAMA_MQA,
          "mixtral": MIXTRAL, "deepseek": DEEPSEEK, "deepseek-bias": DEEPSEEK_BIAS, "deepseek-mtp": DEEPSEEK_MTP,
          "deepseek-mtp-split": DEEPSEEK_MTP_SPLIT, "dense-doc": DENSE_DOC, "llama-doc": LLAMA_DOC,
          "mixtral-doc": MIXTRAL_DOC, "deepseek-doc": DEEPSEEK_DOC, "moe-global": MOE_GLOBAL,
          "mixtral-global": MIXTRAL_GLOBAL, "deepseek-sequence": DEEPSEEK_SEQUENCE}
GLOBAL_AUX_MODELS = ("moe-global", "mixtral-global")
DOCUMENT_MODELS = ("dense-doc", "llama-doc", "mixtral-doc", "deepseek-doc")
LLAMA_FAMILY = ("llama", "llama-mqa", "mixtral")
DEEPSEEK_FAMILY = ("deepseek", "deepseek-bias", "deepseek-mtp", "deepseek-mtp-split")
TOLERANCE = 1e-9

AXES = ("dp", "tp", "pp", "cp", "ep")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
CP_VARIANTS = ("ring", "all-gather", "ulysses")

MATRIX = [  # (ranks, model, options); every option not given is the default (no ZeRO, no recomputation, …)
    # one axis with the ZeRO stages and recomputation modes
    (2, "dense", {"dp": 2, "zero": 1, "recompute": "selective"}),
    (2, "dense", {"dp": 2, "zero": 2, "recompute": "full"}),
    (2, "dense", {"dp": 2, "zero": 3}),
    (2, "dense", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "dense", {"pp": 2, "schedule": "zbv", "recompute": "selective"}),
    (2, "dense", {"cp": 2, "cp_attention": "all-gather", "zero": 2, "recompute": "full"}),
    (2, "moe", {"dp": 2, "ep": 2, "zero": 2, "recompute": "full"}),
    (2, "moe", {"dp": 2, "ep": 2, "zero": 3, "recompute": "selective"}),
    # dp · tp
    (4, "dense", {"dp": 2, "tp": 2, "sp": True, "zero": 1, "recompute": "full"}),
    (4, "dense", {"dp": 2, "tp": 2, "zero": 3, "recompute": "selective"}),
    (4, "dense", {"dp": 2, "tp": 2, "sp": True, "zero": 2}),
    # dp · pp
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 1, "recompute": "selective"}),
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "gpipe", "zero": 2, "microbatches": 4}),
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "dualpipev", "zero": 3, "recompute": "full"}),
    # dp · cp
    (4, "dense", {"dp": 2, "cp": 2, "cp_attention": "ring", "zero": 1, "recompute": "full"}),
    (4, "dense", {"dp": 2, "cp": 2, "cp_attention": "ulysses", "zero": 2}),
    (4, "dense", {"dp": 2, "cp": 2, "cp_attention": "all-gather", "zero": 3, "recompute": "selective"}),
    # tp · pp
    (4, "dense", {"tp": 2, "pp": 2, "sp": True, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4,
                  "recompute": "full"}),
    (4, "dense", {"tp": 2, "pp": 2, "schedule": "zb", "recompute": "selective"}),
    # tp · cp (ZeRO shards over the cp ranks, which sum their gradients)
    (4, "dense", {"tp": 2, "cp": 2, "sp": True, "cp_attention": "ulysses", "zero": 1, "recompute": "selective"}),
    (4, "dense", {"tp": 2, "cp": 2, "cp_attention": "ring", "zero": 3, "recompute": "full"}),
    # pp · cp
    (4, "dense", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "gpipe", "zero": 2}),
    (4, "dense", {"pp": 2, "cp": 2, "cp_attention": "all-gather", "schedule": "zbv", "zero": 1,
                  "recompute": "full"}),
    (4, "dense", {"pp": 2, "cp": 2, "cp_attention": "ulysses", "schedule": "dualpipev", "microbatches": 4,
                  "zero": 3, "recompute": "selective"}),
    # ep with each axis (ep is carved out of dp)
    (4, "moe", {"dp": 4, "ep": 2, "zero": 1, "recompute": "selective"}),
    (4, "moe", {"dp": 4, "ep": 4, "zero": 3}),
    (4, "moe", {"dp": 4, "ep": 2, "zero": 2, "recompute": "full"}),
    (4, "moe", {"dp": 2, "ep": 2, "tp": 2, "sp": True, "zero": 2, "recompute": "full"}),
    (4, "moe", {"dp": 2, "ep": 2, "tp": 2, "zero": 1}),
    (4, "moe", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ulysses", "zero": 1, "recompute": "selective"}),
    (4, "moe", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ring", "zero": 3, "recompute": "full"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b", "zero": 2, "recompute": "full"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "zbv", "recompute": "selective"}),
    # every schedule beside each other axis, every attention variant beside each other axis
    (4, "dense", {"tp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 4, "recompute": "full"}),
    (4, "dense", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "1f1b", "recompute": "selective"}),
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero": 1}),
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "zb", "zero": 3, "recompute": "selective"}),
    (4, "dense", {"pp": 2, "cp": 2, "cp_attention": "ulysses", "schedule": "zb", "microbatches": 4}),
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "zbv", "zero": 2, "recompute": "full"}),
    (4, "dense", {"tp": 2, "pp": 2, "sp": True, "schedule": "zbv", "microbatches": 4}),
    (4, "dense", {"tp": 2, "pp": 2, "schedule": "dualpipev", "recompute": "selective"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "gpipe", "zero": 3, "recompute": "selective"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero": 1}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "zb", "recompute": "full"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "dualpipev", "zero": 2}),
    (4, "moe", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "all-gather", "zero": 2}),
    (4, "moe-bias", {"dp": 2, "ep": 2, "pp": 2, "schedule": "dualpipev", "zero": 3}),
    (4, "moe-bias", {"dp": 2, "ep": 2, "tp": 2, "sp": True, "zero": 1, "recompute": "selective"}),
    (4, "moe-bias", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ulysses", "zero": 2}),
    # the 8-rank three-axis layouts
    (8, "dense", {"dp": 2, "tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"}),
    (8, "dense", {"tp": 2, "cp": 2, "pp": 2, "sp": True, "cp_attention": "ring", "schedule": "interleaved",
                  "virtual_stages": 2}),
    (8, "dense", {"dp": 2, "tp": 2, "cp": 2, "cp_attention": "all-gather", "zero": 1}),
    (8, "moe", {"dp": 4, "ep": 2, "pp": 2, "schedule": "1f1b", "zero": 3}),
    # the llama family: every pair of axes, TP beyond the KV heads, Ulysses with replicated KV heads, Mixtral
    (2, "llama", {"dp": 2, "zero": 3, "recompute": "full"}),
    (2, "llama", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "llama-mqa", {"tp": 2, "recompute": "full"}),  # 1 KV head on 2 TP ranks: replicated, gradients summed
    (2, "llama", {"pp": 2, "schedule": "zbv"}),  # the untied head on the last stage
    (2, "llama-mqa", {"cp": 2, "cp_attention": "ulysses"}),  # 1 KV head over 2 CP ranks: replicated
    (2, "mixtral", {"dp": 2, "ep": 2, "zero": 2}),
    (4, "llama", {"dp": 2, "tp": 2, "sp": True, "zero": 1}),
    (4, "llama", {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 2, "recompute": "selective"}),
    (4, "llama-mqa", {"dp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2}),  # the tied exchange
    (4, "llama", {"dp": 2, "cp": 2, "cp_attention": "all-gather", "zero": 3}),
    (4, "llama", {"tp": 2, "pp": 2, "sp": True, "schedule": "gpipe", "microbatches": 4}),
    (4, "llama", {"tp": 2, "cp": 2, "cp_attention": "ulysses"}),  # 1 KV head per TP rank over 2 CP ranks
    (4, "llama-mqa", {"tp": 4, "sp": True}),  # 1 KV head on 4 TP ranks
    (4, "llama", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "1f1b"}),
    (4, "mixtral", {"dp": 2, "ep": 2, "tp": 2, "sp": True}),
    (4, "mixtral", {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b", "zero": 1}),
    (4, "mixtral", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ring"}),
    # DeepSeek-V3: every pair of axes; its context parallelism moves the compressed latent in every variant (ring:
    # around the ring; all-gather; Ulysses, which sends q and the output by heads besides)
    (2, "deepseek", {"dp": 2, "zero": 3, "recompute": "full"}),
    (2, "deepseek", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "deepseek-bias", {"tp": 2}),
    (2, "deepseek", {"pp": 2, "schedule": "zbv"}),
    (2, "deepseek", {"cp": 2, "cp_attention": "all-gather", "recompute": "selective", "zero": 2}),
    (2, "deepseek", {"dp": 2, "ep": 2, "zero": 2}),
    (4, "deepseek", {"dp": 2, "tp": 2, "sp": True, "zero": 1}),
    (4, "deepseek", {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 2, "recompute": "selective"}),
    (4, "deepseek", {"dp": 2, "cp": 2, "cp_attention": "all-gather", "zero": 1}),
    (4, "deepseek", {"tp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 4}),
    (4, "deepseek", {"tp": 2, "cp": 2, "cp_attention": "all-gather", "sp": True}),
    (4, "deepseek", {"pp": 2, "cp": 2, "cp_attention": "all-gather", "schedule": "zb"}),
    (4, "deepseek", {"dp": 2, "ep": 2, "tp": 2, "sp": True}),
    (4, "deepseek", {"dp": 2, "ep": 2, "pp": 2, "schedule": "dualpipev", "zero": 1}),
    (4, "deepseek", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "all-gather", "zero": 3, "recompute": "full"}),
    (2, "deepseek", {"cp": 2, "cp_attention": "ulysses", "recompute": "selective", "zero": 1}),
    (4, "deepseek", {"tp": 2, "cp": 2, "cp_attention": "ulysses", "sp": True, "recompute": "full"}),
    (4, "deepseek", {"dp": 2, "cp": 2, "cp_attention": "ulysses", "zero": 3}),
    (4, "deepseek", {"pp": 2, "cp": 2, "cp_attention": "ulysses", "schedule": "zbv"}),
    (4, "deepseek-bias", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ulysses", "zero": 2, "recompute": "selective"}),
    (2, "deepseek", {"cp": 2, "cp_attention": "ring", "recompute": "full", "zero": 2}),
    (4, "deepseek", {"cp": 4, "cp_attention": "ring", "recompute": "selective"}),
    (4, "deepseek", {"tp": 2, "cp": 2, "cp_attention": "ring", "sp": True}),
    (4, "deepseek", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "1f1b"}),
    (4, "deepseek-bias", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ring", "zero": 3}),
    (4, "deepseek", {"cp": 4, "cp_attention": "ulysses"}),
    (4, "deepseek-bias", {"dp": 4, "ep": 4, "zero": 3}),
    (4, "deepseek-bias", {"dp": 2, "ep": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2}),
    (4, "deepseek-mtp", {"dp": 2, "tp": 2, "zero": 1, "recompute": "full"}),
    (4, "deepseek-mtp", {"dp": 4, "ep": 2, "zero": 3, "recompute": "selective"}),
    (4, "deepseek-mtp", {"dp": 2, "ep": 2, "tp": 2, "zero": 2, "microbatches": 2}),
    # MTP on the last stage: wte read there too, its gradient summed with the first stage's, every schedule
    (4, "deepseek-mtp", {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 2}),
    (4, "deepseek-mtp", {"pp": 2, "tp": 2, "schedule": "zb", "microbatches": 4, "recompute": "selective"}),
    (4, "deepseek-mtp", {"dp": 2, "pp": 2, "schedule": "dualpipev", "zero": 3}),
    (4, "deepseek-mtp", {"dp": 2, "ep": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero": 1}),
    (4, "deepseek-mtp", {"pp": 2, "dp": 2, "schedule": "gpipe", "microbatches": 4}),
    (4, "deepseek-mtp", {"pp": 2, "dp": 2, "schedule": "zbv"}),
    # MTP on split sequences: its modules on SP's slices, and on CP's zigzag chunks in every variant (the next
    # tokens of a chunk's last positions held by another CP rank; the last positions of the whole sequence masked)
    (2, "deepseek-mtp-split", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "deepseek-mtp-split", {"cp": 2, "cp_attention": "ring"}),
    (2, "deepseek-mtp-split", {"cp": 2, "cp_attention": "all-gather", "zero": 1}),
    (2, "deepseek-mtp-split", {"cp": 2, "cp_attention": "ulysses", "recompute": "full"}),
    (4, "deepseek-mtp-split", {"tp": 2, "cp": 2, "cp_attention": "ulysses", "sp": True}),
    (4, "deepseek-mtp-split", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "1f1b"}),
    # packed documents: each axis, ZeRO stage, recomputation mode, schedule and attention variant, every family
    # (RoPE at document positions, MLA's shared RoPE key, CP's chunk pairs across documents)
    (2, "dense-doc", {"dp": 2, "zero": 3, "recompute": "full"}),
    (2, "dense-doc", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "dense-doc", {"pp": 2, "schedule": "zbv"}),
    (2, "dense-doc", {"cp": 2, "cp_attention": "ring", "zero": 1}),
    (2, "dense-doc", {"cp": 2, "cp_attention": "all-gather", "recompute": "selective"}),
    (2, "dense-doc", {"cp": 2, "cp_attention": "ulysses", "recompute": "full"}),
    (2, "llama-doc", {"cp": 2, "cp_attention": "ring"}),
    (2, "llama-doc", {"tp": 2, "sp": True}),
    (2, "mixtral-doc", {"dp": 2, "ep": 2, "zero": 2}),
    (2, "deepseek-doc", {"cp": 2, "cp_attention": "ring", "recompute": "full"}),
    (2, "deepseek-doc", {"cp": 2, "cp_attention": "all-gather"}),
    (2, "deepseek-doc", {"cp": 2, "cp_attention": "ulysses", "recompute": "selective"}),
    (4, "dense-doc", {"dp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 4, "zero": 2}),
    (4, "dense-doc", {"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}),
    (4, "dense-doc", {"pp": 2, "cp": 2, "cp_attention": "ring", "schedule": "zb"}),
    (4, "dense-doc", {"pp": 2, "cp": 2, "cp_attention": "all-gather", "schedule": "dualpipev"}),
    (4, "dense-doc", {"dp": 2, "pp": 2, "schedule": "1f1b", "recompute": "selective"}),
    (4, "dense-doc", {"cp": 4, "cp_attention": "ring"}),
    (4, "llama-doc", {"tp": 2, "cp": 2, "cp_attention": "ulysses"}),
    (4, "llama-doc", {"dp": 2, "cp": 2, "cp_attention": "all-gather", "zero": 3}),
    (4, "mixtral-doc", {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b"}),
    (4, "mixtral-doc", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "ring"}),
    (4, "deepseek-doc", {"tp": 2, "cp": 2, "cp_attention": "ring", "sp": True}),
    (4, "deepseek-doc", {"dp": 2, "ep": 2, "pp": 2, "schedule": "zbv", "zero": 1}),
    (4, "deepseek-doc", {"cp": 4, "cp_attention": "ulysses"}),
    # the global aux loss: token sets cut by dp, cp, microbatches, sp and pp, experts moved by ep — one loss
    (2, "moe-global", {"dp": 2, "microbatches": 2, "zero": 1}),
    (2, "moe-global", {"dp": 2, "ep": 2, "zero": 3, "recompute": "full"}),
    (2, "moe-global", {"cp": 2, "cp_attention": "ring", "microbatches": 2}),
    (2, "moe-global", {"tp": 2, "sp": True, "recompute": "selective"}),
    (2, "moe-global", {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    (2, "mixtral-global", {"dp": 2, "ep": 2, "microbatches": 4, "zero": 2}),
    (4, "moe-global", {"dp": 4, "ep": 2, "microbatches": 2, "zero": 2}),
    (4, "moe-global", {"dp": 2, "ep": 2, "pp": 2, "schedule": "zbv", "microbatches": 2}),
    (4, "moe-global", {"dp": 2, "ep": 2, "cp": 2, "cp_attention": "all-gather", "microbatches": 2}),
    (4, "mixtral-global", {"dp": 2, "tp": 2, "sp": True, "ep": 2}),
    (4, "mixtral-global", {"pp": 2, "cp": 2, "cp_attention": "ulysses", "schedule": "gpipe", "microbatches": 4}),
    (2, "deepseek-sequence", {"cp": 2, "cp_attention": "ring", "recompute": "full"}),
    (2, "deepseek-sequence", {"cp": 2, "cp_attention": "all-gather", "microbatches": 2}),
    (2, "deepseek-sequence", {"cp": 2, "cp_attention": "ulysses"}),
    (2, "deepseek-sequence", {"tp": 2, "sp": True, "recompute": "selective"}),
    (4, "deepseek-sequence", {"tp": 2, "cp": 2, "sp": True, "cp_attention": "ring"}),
    (4, "deepseek-sequence", {"dp": 2, "cp": 2, "ep": 2, "cp_attention": "all-gather", "zero": 1}),
]
# pipelines on device arrays: the CuPy double (tests/support/fake_cupy.py) with an MPI that is not CUDA-aware, so every
# activation and gradient between stages is staged through host memory (MPIPARALLEL_TEST_ARRAYS=cupy: real CuPy)
DEVICE_MATRIX = [
    (4, "dense", {"dp": 2, "pp": 2, "schedule": "1f1b", "zero": 3, "device": "gpu"}),
    (4, "dense", {"tp": 2, "pp": 2, "sp": True, "schedule": "zbv", "recompute": "selective", "device": "gpu"}),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero": 1,
                "device": "gpu"}),
    (4, "deepseek", {"tp": 2, "cp": 2, "cp_attention": "all-gather", "sp": True, "recompute": "selective",
                     "device": "gpu"}),
    # packed documents on device arrays: the masks made on the host and moved, learned positions per document
    (4, "dense-doc", {"dp": 2, "cp": 2, "cp_attention": "ring", "device": "gpu"}),
    (4, "llama-doc", {"tp": 2, "pp": 2, "schedule": "1f1b", "recompute": "selective", "device": "gpu"}),
]
# expert parallelism across 2 emulated nodes of 2 ranks (MPIPARALLEL_RANKS_PER_NODE=2), n_group 2 = the nodes: the
# flat all-to-allv and DeepSeek-V3's two-hop node-limited dispatch (with tp: EP groups of one rank per node; on device
# arrays)
NODES = {"MPIPARALLEL_RANKS_PER_NODE": "2"}
NODES_MATRIX = [
    (4, "deepseek", {"dp": 4, "ep": 4, "ep_dispatch": "flat"}),
    (4, "deepseek", {"dp": 4, "ep": 4, "ep_dispatch": "hierarchical", "zero": 1}),
    (4, "deepseek", {"dp": 2, "tp": 2, "ep": 2, "ep_dispatch": "hierarchical"}),
    (4, "deepseek-mtp", {"dp": 4, "ep": 4, "ep_dispatch": "hierarchical", "recompute": "full"}),
    (4, "deepseek", {"dp": 4, "ep": 4, "ep_dispatch": "hierarchical", "device": "gpu"}),  # device arrays, staged
]
DEVICE_ARRAYS = ({"MPIPARALLEL_TEST_ARRAYS": "cupy"} if os.environ.get("MPIPARALLEL_TEST_ARRAYS") == "cupy"
                 else {"MPIPARALLEL_TEST_ARRAYS": "fake", "MPIPARALLEL_CUDA_AWARE": "0"})
THREE_AXIS_LAYOUTS = [  # (ranks, model, axis sizes, what else must be on); MoE's ep is carved out of dp
    (8, "dense", {"dp": 2, "tp": 2, "pp": 2}, "sp"),
    (8, "dense", {"tp": 2, "cp": 2, "pp": 2}, None),
    (8, "dense", {"dp": 2, "tp": 2, "cp": 2}, "zero1"),
    (4, "moe", {"dp": 2, "ep": 2, "pp": 2}, None),
]


def axis_sizes(ranks: int, options: dict) -> dict[str, int]:
    """Every axis's size in a row (dp: the ranks left over, as the mesh fills it in)."""
    sizes = {axis: options.get(axis, 1) for axis in ("tp", "pp", "cp", "ep")}
    return {"dp": options.get("dp", ranks // (sizes["tp"] * sizes["pp"] * sizes["cp"])), **sizes}


def features(ranks: int, options: dict) -> set[str]:
    """What a row combines: its axes > 1, sequence parallelism, its ZeRO stage (when there are ranks to shard
    over: dp·cp > 1, and with ep the experts' too: dp/ep·cp > 1), its recomputation mode, its schedule (with pp)
    and its attention variant (with cp)."""
    sizes = axis_sizes(ranks, options)
    found = {axis for axis, size in sizes.items() if size > 1}
    if options.get("sp"):
        found.add("sp")
    if options.get("zero", 0) and sizes["dp"] // sizes["ep"] * sizes["cp"] > 1:
        found.add(f"zero{options['zero']}")
    if options.get("recompute", "none") != "none":
        found.add(f"recompute-{options['recompute']}")
    if sizes["pp"] > 1:
        found.add(options.get("schedule", "1f1b"))
    if sizes["cp"] > 1:
        found.add(options.get("cp_attention", "ring"))
    return found


def required_combinations() -> set[frozenset[str]]:
    """Every pair of axes; each axis with each ZeRO stage and recomputation mode; sequence parallelism with each
    other axis; each pipeline schedule and each attention variant with each other axis."""
    required = {frozenset(pair) for pair in itertools.combinations(AXES, 2)}
    modes = ("zero1", "zero2", "zero3", "recompute-selective", "recompute-full")
    required |= {frozenset((axis, mode)) for axis in AXES for mode in modes}
    required |= {frozenset(("sp", axis)) for axis in AXES if axis != "tp"}
    required |= {frozenset((schedule, axis)) for schedule in SCHEDULES for axis in AXES if axis != "pp"}
    required |= {frozenset((variant, axis)) for variant in CP_VARIANTS for axis in AXES if axis != "cp"}
    return required


def covered(combination: frozenset[str]) -> bool:
    return any(combination <= features(ranks, options) for ranks, _, options in MATRIX)


def test_the_matrix_covers_every_pair_of_axes():
    missing = sorted(sorted(combination) for combination in required_combinations() if not covered(combination))
    assert not missing, f"no row of MATRIX combines {missing}"


def test_the_llama_family_rows_cover_every_pair_of_axes():
    pairs = {frozenset(pair) for pair in itertools.combinations(AXES, 2)}
    missing = sorted(sorted(pair) for pair in pairs
                     if not any(pair <= features(ranks, options) for ranks, model, options in MATRIX
                                if model in LLAMA_FAMILY))
    assert not missing, f"no llama-family row of MATRIX combines {missing}"


def test_the_deepseek_rows_cover_every_pair_of_axes():
    pairs = {frozenset(pair) for pair in itertools.combinations(AXES, 2)}
    missing = sorted(sorted(pair) for pair in pairs
                     if not any(pair <= features(ranks, options) for ranks, model, options in MATRIX
                                if model in DEEPSEEK_FAMILY))
    assert not missing, f"no deepseek_v3 row of MATRIX combines {missing}"


def test_the_document_rows_cover_every_axis_schedule_variant_and_family():
    document_rows = [(ranks, model, options) for ranks, model, options in MATRIX if model in DOCUMENT_MODELS]
    found = set().union(*(features(ranks, options) for ranks, _, options in document_rows))
    wanted = {*AXES, "sp", "zero1", "zero2", "zero3", "recompute-selective", "recompute-full", *SCHEDULES,
              *CP_VARIANTS}
    assert not wanted - found, f"no document row has {sorted(wanted - found)}"
    assert {model for _, model, _ in document_rows} == set(DOCUMENT_MODELS)
    latent_variants = {options.get("cp_attention") for _, model, options in document_rows if model == "deepseek-doc"}
    assert set(CP_VARIANTS) <= latent_variants  # MLA's three context-parallel variants


def test_the_matrix_has_the_three_axis_layouts():
    for layout_ranks, model, sizes, extra in THREE_AXIS_LAYOUTS:
        assert any(ranks == layout_ranks and name == model
                   and all(axis_sizes(ranks, options)[axis] == size for axis, size in sizes.items())
                   and (extra is None or extra in features(ranks, options))
                   for ranks, name, options in MATRIX), (model, sizes, extra)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("serial")
    run_on_ranks(1, composition_checks.serial_references, models=MODELS, directory=str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def results(references) -> dict[int, dict]:
    """Every row's result by its index in MATRIX: one launch per rank count."""
    found = {}
    for ranks in sorted({row[0] for row in MATRIX}):
        indices = [i for i, row in enumerate(MATRIX) if row[0] == ranks]
        runs = [(MATRIX[i][1], MATRIX[i][2]) for i in indices]
        launch = run_on_ranks(ranks, composition_checks.matches_serial, timeout=600, models=MODELS,
                              runs=runs, references=references)[0]
        found |= dict(zip(indices, launch, strict=True))
    return found


@pytest.fixture(scope="module")
def device_results(references) -> list[dict]:
    return run_on_ranks(4, composition_checks.matches_serial, timeout=600, env=DEVICE_ARRAYS,
                        models=MODELS, runs=[(model, options) for _, model, options in DEVICE_MATRIX],
                        references=references)[0]


@pytest.fixture(scope="module")
def nodes_results(references) -> list[dict]:
    return run_on_ranks(4, composition_checks.matches_serial, timeout=600, env={**NODES, **DEVICE_ARRAYS},
                        models=MODELS, runs=[(model, options) for _, model, options in NODES_MATRIX],
                        references=references)[0]


def label(row: tuple) -> str:
    ranks, model, options = row
    parts = [f"{key}{value}" if not isinstance(value, bool) else key for key, value in options.items()]
    return f"{ranks}ranks-{model}-" + "-".join(parts)


def assert_equals_serial(result: dict, model: str) -> None:
    """Every step ran; every loss, gradient (each parameter, each step) and weight within TOLERANCE of serial."""
    settings, options = MODELS[model], result["options"]
    steps = settings["steps"]
    config = model_config(TrainSettings.from_options(**settings))
    assert result["steps"] == steps and result["losses"] == steps + 1, options  # + the validation loss
    assert result["gradients_compared"] == steps * len(parameter_shapes(config)), options
    assert result["loss_error"] <= TOLERANCE, (options, result["loss_error"])
    assert result["gradient_error"] <= TOLERANCE, (options, result["gradient_error"])
    assert result["weight_error"] <= TOLERANCE, (options, result["weight_error"])


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=[label(row) for row in MATRIX])
def test_every_composition_equals_serial(results, index):
    assert_equals_serial(results[index], MATRIX[index][1])


@pytest.mark.parametrize("index", range(len(DEVICE_MATRIX)), ids=[label(row) for row in DEVICE_MATRIX])
def test_pipelines_on_device_arrays_equal_serial(device_results, index):
    assert_equals_serial(device_results[index], DEVICE_MATRIX[index][1])


@pytest.mark.parametrize("index", range(len(NODES_MATRIX)), ids=[label(row) for row in NODES_MATRIX])
def test_expert_parallelism_across_two_nodes_equals_serial_with_either_dispatch(nodes_results, index):
    assert_equals_serial(nodes_results[index], NODES_MATRIX[index][1])


TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "4", "--batch-size", "8", "--steps", "1"]
REFUSED = [  # (arguments, what the one error must say): what the axes' arithmetic rules out together
    (["-n", "8", "--tp", "4", "--cp", "2", "--sp", "--seq-len", "12"],
     "--sp with --cp 2: each CP rank's 6 tokens must be divisible by tp (4)"),
    (["-n", "8", "--tp", "2", "--cp", "2", "--pp", "2", "--seq-len", "16", "--cp-attention", "ulysses",
      "--n-head", "2", "--n-embd", "16"], "n_head (2) must be divisible by 4"),
    (["-n", "4", "--pp", "2", "--seq-len", "16", "--experts", "4", "--ep", "4"],
     "--ep 4 must divide the data-parallel size 2"),
]


@pytest.mark.parametrize("args, message", REFUSED, ids=["sp-cp-tokens", "ulysses-heads-with-pp", "ep-over-pp-dp"])
def test_combinations_the_arithmetic_rules_out_get_one_clear_error(args, message):
    assert message in train_error(*TINY, *args)


@pytest.fixture(scope="module")
def unhooked_differences() -> dict[str, float]:
    return run_on_ranks(2, composition_checks.unhooked_gradients_match_hooked, zeros=[0, 1, 2, 3])[0]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_step_run_without_the_engines_hooks_reduces_the_same_gradients(unhooked_differences, zero):
    """What a pipeline does to the data-parallel engine (no per-unit hooks, split backward), here with the
    overlap on that `train` turns off for pipelines: every bucket is still reduced, to the hooked step's sums."""
    assert unhooked_differences[str(zero)] <= 1e-12, (zero, unhooked_differences)
