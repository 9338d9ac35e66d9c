"""Training speed of our hand-written GPT-2 and llama against PyTorch eager, same threads, in one run.

Two comparisons (`--model gpt2|llama|both`, default both), each of one model against its PyTorch twin:

    GPT-2  against a nanoGPT-style GPT-2 written here from torch.nn primitives (weights copied from ours);
    llama  against transformers' LlamaForCausalLM, loaded by `from_pretrained` from our weights as
           `mpiparallel.checkpoints.hugging_face.save_pretrained` writes them, attn_implementation "eager"
           (`--hf-attention`).

Both sides start from the same weights, see the same byte batches and take the same AdamW steps (lr 3e-4, betas
(0.9, 0.95), eps 1e-8, weight decay `--weight-decay` [0] on ≥2-D weights only), so their losses agree step by
step; the first step's losses and every tensor's gradient must agree (relative differences within
`FIRST_LOSS_TOLERANCE` and `FIRST_GRADIENT_TOLERANCE`: 1e-4 and 1e-3 in float32) or the script stops, since the
timings would then compare different computations. The steps alternate (ours, theirs, ours, …) so machine
noise hits both alike. A step is forward + backward + optimizer update + zeroing the gradients. Reported: the
median tokens/s of each after the warmup steps, their ratio, the model FLOPs per step and how close our step
comes to the time the matrix multiplications alone need at NumPy's measured GEMM rate.

FLOPs per step (nanoGPT's / PaLM's count): 6·N·tokens + 12·L·T·C·tokens, where N = the parameters that enter a
matrix product (GPT-2: all but the position embedding, the tied token embedding counting once, as the LM head's
GEMM; llama: all but the token embedding, a lookup, when the head is untied), tokens = B·T, and the second term
is attention's q·kᵀ and p·v (2·2·T·C per token and layer forward, ×3 with backward) over the full T×T scores, as
the convention has it; both implementations of GPT-2 skip most of the masked half (ours in causal query blocks,
torch's flash SDPA kernel likewise; transformers' eager llama attention does not). Grouped-query attention
shares K and V between query heads but not the products: the attention term is the same. The matmul-bound time
is these FLOPs at the rate NumPy reaches on this step's GEMM shapes (`step_gemms`, timed between the steps), so
it is the time a step would take if it were nothing but full-rate matrix products.

    python3 scripts/bench_train.py                     # both: 4 layers, 256 wide, 4 heads of 64, T=128, B=8
    python3 scripts/bench_train.py --model llama --layers 2 --steps 10 --profile
    python3 scripts/bench_train.py --threads 2         # NumPy's BLAS and torch both on 2 threads

The llama default is the GPT-2 default's size class: 4 heads of 64 sharing 2 KV heads (`--kv-heads`), SwiGLU
width by the default rule (8/3·C rounded up to a multiple of 64: 704 for C = 256; `--ffn-hidden`), untied head,
the byte vocabulary. `--preset smollm-135m` is SmolLM-135M's shape (30 layers × 576, 9 heads / 3 KV heads,
SwiGLU 1536, vocab 49152, T = 1024 here); flags given explicitly override a preset's values.

torch is only needed for the comparisons (`pip install -e '.[interop]'`: the pinned CPU build, and transformers
for llama); without it the script reports ours alone.

On a GPU (`--device gpu`, needs CuPy; torch on CUDA for the comparison) the same step runs on CuPy arrays against
PyTorch eager on the same GPU, both in float32 with full-precision matrix products unless `--tf32`, and the
report adds MFU: model FLOPs per second over the GPU's peak for that precision (`--peak-tflops`, or a table of
known GPUs). `--compute-dtype bfloat16` is mixed precision: ours computes in bfloat16 over float32 masters (as
`train --compute-dtype bfloat16`), PyTorch under autocast(bfloat16) over float32 weights — each library's own
bfloat16 training, checked to agree on the first step (loss within 1e-3, gradients within 5e-2; measured on the
CPU: 4e-5 and 8e-3). GPT-2 124M as in the GPU issue, and SmolLM-135M:

    python3 scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10
    python3 scripts/bench_train.py --device gpu --preset smollm-135m --batch 8 --steps 10
    python3 scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10 --compute-dtype bfloat16
"""

from __future__ import annotations

import os
import sys


def _threads_from_command_line(argv: list[str]) -> int:
    """`--threads N` read off the command line before NumPy loads: BLAS fixes its thread pool when it starts."""
    for i, word in enumerate(argv):
        if word.startswith("--threads="):
            return int(word.split("=", 1)[1])
        if word == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 1


THREADS = _threads_from_command_line(sys.argv[1:])
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy/torch load BLAS
    os.environ[_variable] = str(THREADS)

import argparse  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import profile_step  # noqa: E402  (this directory: the --profile reports)

from collectives.backend import dtype_named, to_host  # noqa: E402
from models.families import name_map  # noqa: E402
from models.layers import QUERY_BLOCK, RECOMPUTE_MODES  # noqa: E402
from models.transformer import GPTConfig, Transformer  # noqa: E402
from mpiparallel.process import keep_freed_memory  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(THREADS)
except ImportError:
    torch = None

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.0


def byte_batches(batch: int, length: int) -> np.ndarray:
    """This repository's source as bytes, cut into llm.c batches: the window of step s is batch s mod K."""
    text = b"".join(path.read_bytes() for path in sorted(ROOT.glob("**/*.py")) + [ROOT / "README.md"])
    while len(text) < batch * length + 1:
        text += text
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def window(tokens: np.ndarray, step: int, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    span = batch * length
    j = step % ((len(tokens) - 1) // span)
    chunk = tokens[j * span: j * span + span + 1]
    return chunk[:-1].reshape(batch, length), chunk[1:].reshape(batch, length)


class AdamW:
    """Fallback for checkouts without mpiparallel.optim: PyTorch's AdamW (bias correction, decoupled weight
    decay on ≥2-D weights), in place on NumPy arrays."""

    def __init__(self, params, lr: float = LR, betas: tuple[float, float] = BETAS, eps: float = EPS,
                 weight_decay: float = WEIGHT_DECAY) -> None:
        self.params, self.lr, self.betas, self.eps, self.weight_decay = params, lr, betas, eps, weight_decay
        self.m = [np.zeros_like(p.data) for p in params]
        self.v = [np.zeros_like(p.data) for p in params]
        self.scratch = [np.empty_like(p.data) for p in params]
        self.t = 0

    def step(self) -> None:
        self.t += 1
        beta1, beta2 = self.betas
        step_size = self.lr / (1 - beta1 ** self.t)
        root_correction = (1 - beta2 ** self.t) ** 0.5
        for p, m, v, scratch in zip(self.params, self.m, self.v, self.scratch, strict=True):
            if self.weight_decay and p.data.ndim >= 2:
                p.data *= 1 - self.lr * self.weight_decay
            m *= beta1
            np.multiply(p.grad, 1 - beta1, out=scratch)
            m += scratch
            v *= beta2
            np.multiply(p.grad, p.grad, out=scratch)
            scratch *= 1 - beta2
            v += scratch
            np.sqrt(v, out=scratch)  # denominator: sqrt(v)/sqrt(1 − β2^t) + eps
            scratch /= root_correction
            scratch += self.eps
            np.divide(m, scratch, out=scratch)
            scratch *= step_size
            p.data -= scratch


class Device:
    """Where both models run: the CPU (NumPy, torch on CPU) or the GPU (CuPy, torch on CUDA); `sync()` waits for
    queued GPU work so wall-clock times cover it."""

    def __init__(self, kind: str, tf32: bool) -> None:
        self.kind, self.xp, self.torch_device = kind, np, "cpu"
        if kind == "gpu":
            from collectives import backend

            reason = backend.gpu_unavailable_reason()
            if reason is not None:
                sys.exit(f"--device gpu: {reason}")
            self.xp = backend.gpu_array_module()
            self.torch_device = "cuda" if torch is not None and torch.cuda.is_available() else None
            if torch is not None:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.backends.cudnn.allow_tf32 = tf32

    def sync(self) -> None:
        if self.kind == "gpu":
            self.xp.cuda.get_current_stream().synchronize()
            if self.torch_device == "cuda":
                torch.cuda.synchronize()

    def name(self) -> str:
        if self.kind == "cpu":
            return f"CPU, {THREADS} thread{'s' if THREADS > 1 else ''}"
        name = self.xp.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)


# Dense peak TFLOP/s by GPU name fragment and precision (vendor datasheets; SXM boards).
PEAK_TFLOPS = {"H200": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4},
               "H100": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4},
               "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0}}


def peak_tflops(device: Device, precision: str, given: float | None) -> float | None:
    if given is not None:
        return given
    name = device.name() if device.kind == "gpu" else ""
    return next((peaks[precision] for fragment, peaks in PEAK_TFLOPS.items() if fragment in name), None)


def build_ours(config: GPTConfig, dtype, xp=np, query_block: int = QUERY_BLOCK,
               recompute: str = "none", weight_decay: float = WEIGHT_DECAY,
               compute_dtype: str | None = None) -> tuple[Transformer, object]:
    """Our model and optimizer: mpiparallel.optim.AdamW when the package has it, else the inline one above. With a
    `compute_dtype` (bfloat16) the model computes in it over master weights at `dtype`, as `train --compute-dtype`."""
    extra = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
    model = Transformer(config, seed=0, dtype=dtype, xp=xp, query_block=query_block, recompute=recompute, **extra)
    try:
        from mpiparallel.optim import AdamW as ProjectAdamW
    except ImportError:
        return model, AdamW(model.parameters(), weight_decay=weight_decay)
    return model, ProjectAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)


def page_faults() -> int:
    """This process's minor page faults so far: each a fresh page the kernel zeroed on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def weights_of(param) -> np.ndarray:
    """A parameter's full-precision weights: its master copy under mixed precision (the twin starts from the
    weights our optimizer updates), else its data."""
    return param.master if getattr(param, "master", None) is not None else param.data


def ours_step(model: Transformer, optimizer, tokens: np.ndarray, targets: np.ndarray) -> float:
    model.zero_grad()
    loss, saved = model.forward(tokens, targets)
    model.backward(saved)
    optimizer.step()
    return loss


if torch is not None:

    class TorchBlock(nn.Module):
        def __init__(self, n_embd: int, n_head: int, attention: str) -> None:
            super().__init__()
            self.n_head, self.attention = n_head, attention
            self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5), nn.LayerNorm(n_embd, eps=1e-5)
            self.c_attn, self.attn_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            self.c_fc, self.mlp_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
            self.gelu = nn.GELU(approximate="tanh")

        def attend(self, x):
            batch, length, channels = x.shape
            heads = self.c_attn(x).view(batch, length, 3, self.n_head, channels // self.n_head)
            q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, d)
            if self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / (q.shape[-1] ** 0.5))
                mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
                y = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
            return self.attn_proj(y.transpose(1, 2).reshape(batch, length, channels))

        def forward(self, x):
            x = x + self.attend(self.ln_1(x))
            return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))

    class TorchGPT(nn.Module):
        """nanoGPT-style GPT-2 from torch.nn primitives, weights copied from ours (Linear holds Conv1D's transpose)."""

        def __init__(self, ours: Transformer, attention: str, device: str = "cpu") -> None:
            super().__init__()
            config = ours.config
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
            self.h = nn.ModuleList(TorchBlock(config.n_embd, config.n_head, attention) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, eps=1e-5)
            dtype = torch.float64 if ours.params["transformer.wte.weight"].data.dtype == np.float64 else torch.float32
            self.to(dtype)
            with torch.no_grad():
                for name, ours_name in self.names().items():
                    value = torch.from_numpy(np.ascontiguousarray(to_host(weights_of(ours.params[ours_name]))))
                    linear_weight = value.ndim == 2 and not name.startswith(("wte", "wpe"))
                    self.get_parameter(name).copy_(value.T if linear_weight else value)
            self.to(device)

        def names(self) -> dict[str, str]:
            """torch parameter name -> our Hugging Face name."""
            mapping = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                       "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
            ours_of = {"ln_1": "ln_1", "ln_2": "ln_2", "c_attn": "attn.c_attn", "attn_proj": "attn.c_proj",
                       "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
            for i in range(len(self.h)):
                for module, ours_module in ours_of.items():
                    for kind in ("weight", "bias"):
                        mapping[f"h.{i}.{module}.{kind}"] = f"transformer.h.{i}.{ours_module}.{kind}"
            return mapping

        def gradients(self) -> dict[str, np.ndarray]:
            """Every parameter's gradient by our name, in our [in, out] layout."""
            return {ours_name: _layout_of_ours(self.get_parameter(name).grad, not name.startswith(("wte", "wpe")))
                    for name, ours_name in self.names().items()}

        def forward(self, tokens, targets):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(positions)
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied LM head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def build_torch(ours: Transformer, attention: str, optimizer: str, device: str = "cpu",
                    weight_decay: float = WEIGHT_DECAY):
        model = TorchGPT(ours, attention, device)
        return model, torch_adamw(model, optimizer, weight_decay)

    def torch_adamw(model, optimizer: str, weight_decay: float):
        """torch.optim.AdamW with our settings: decay on ≥2-D weights only, as mpiparallel.optim.AdamW does."""
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[optimizer]
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        vectors = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **kind)

    class TransformersLlama(nn.Module):
        """transformers' LlamaForCausalLM loaded from our weights (`save_pretrained` into `directory`, then
        `from_pretrained`), with the loss of our head: mean cross-entropy of the logits against the targets."""

        def __init__(self, ours: Transformer, directory: str, attention: str, device: str = "cpu") -> None:
            super().__init__()
            import transformers

            from mpiparallel.checkpoints.hugging_face import save_pretrained

            transformers.utils.logging.disable_progress_bar()  # its loading bar would interleave with our lines
            self.config = ours.config
            save_pretrained(directory, ours.config, {name: weights_of(param) for name, param in ours.params.items()})
            dtype = torch.float64 if ours.params["transformer.wte.weight"].data.dtype == np.float64 else torch.float32
            self.llama = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=dtype,
                                                                       attn_implementation=attention)
            self.llama.config.use_cache = False  # training: no KV cache is built
            self.llama.to(device).train()

        def gradients(self) -> dict[str, np.ndarray]:
            """Every parameter's gradient by our name, in our [in, out] layout (`models.families`' name map)."""
            return {ours: _layout_of_ours(self.llama.get_parameter(theirs).grad, transposed)
                    for ours, theirs, transposed in name_map(self.config)}

        def forward(self, tokens, targets):
            logits = self.llama(input_ids=tokens, use_cache=False).logits
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def _layout_of_ours(grad, transposed: bool) -> np.ndarray:
        value = grad.detach().cpu().numpy()
        return value.T if transposed and value.ndim == 2 else value

    def build_transformers(ours: Transformer, directory: str, attention: str, optimizer: str, device: str = "cpu",
                           weight_decay: float = WEIGHT_DECAY):
        model = TransformersLlama(ours, directory, attention, device)
        return model, torch_adamw(model, optimizer, weight_decay)

    def torch_step(model, optimizer, tokens, targets, bfloat16: bool = False) -> float:
        """One step; `bfloat16`: PyTorch's automatic mixed precision (autocast: bfloat16 matrix products over
        float32 weights, norms and softmax kept in float32) — PyTorch's standard form of a bfloat16 run."""
        optimizer.zero_grad(set_to_none=False)  # like ours: gradients live in buffers zeroed each step
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.item()


def matmul_parameters(config: GPTConfig) -> int:
    """N of the FLOP count: the parameters that enter a matrix product. Not GPT-2's position embedding, nor an
    untied llama's token embedding (lookups); a tied token embedding counts once, as the LM head."""
    lookup = config.n_positions * config.n_embd if not config.is_llama else 0
    if not config.tied:
        lookup += config.vocab_size * config.n_embd
    return config.parameter_count() - lookup


def model_flops(config: GPTConfig, batch: int, length: int) -> float:
    tokens = batch * length
    return 6 * matmul_parameters(config) * tokens + 12 * config.n_layer * length * config.n_embd * tokens


def block_linears(config: GPTConfig) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix of a block, one matrix product each: GPT-2's c_attn, c_proj, c_fc,
    c_proj; llama's q, k, v (KV heads · d wide), o, gate, up, down (ConcatenatedLinear multiplies each apart)."""
    c, width = config.n_embd, config.ffn_width
    if not config.is_llama:
        return [(c, 3 * c), (c, c), (c, width), (width, c)]
    kv = config.kv_heads * config.head_dim
    return [(c, c), (c, kv), (c, kv), (c, c), (c, width), (c, width), (width, c)]


def step_gemms(config: GPTConfig, batch: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...], bool, bool]]:
    """Every matrix product of one training step: (a shape, b shape, transpose a, transpose b), as the layers
    compute them (forward, d(input), d(weight) of each Linear; the attention products batched over B·H: grouped
    KV heads serve several query heads, each query head's products counted)."""
    m, heads, d = batch * length, batch * config.n_head, config.head_dim
    c = config.n_embd
    gemms = []
    for k, n in block_linears(config):
        gemms += [((m, k), (k, n), False, False), ((m, n), (k, n), False, True), ((m, k), (m, n), True, False)]
    attention = [((heads, length, d), (heads, length, d), False, True),      # q·kᵀ
                 ((heads, length, length), (heads, length, d), False, False),  # p·v
                 ((heads, length, d), (heads, length, d), False, True),      # dp = dy·vᵀ
                 ((heads, length, length), (heads, length, d), True, False),  # dv = pᵀ·dy
                 ((heads, length, length), (heads, length, d), False, False),  # dq = ds·k
                 ((heads, length, length), (heads, length, d), True, False)]  # dk = dsᵀ·q
    vocab = config.vocab_size
    head = [((m, c), (vocab, c), False, True),  # logits = x·wteᵀ (or lm_headᵀ)
            ((m, vocab), (vocab, c), False, False),  # dx = dlogits·wte
            ((m, vocab), (m, c), True, False)]  # dwte = dlogitsᵀ·x
    return gemms * config.n_layer + attention * config.n_layer + head


def random_operand(xp, shape: tuple[int, ...], dtype) -> Any:
    """Standard normal values drawn where they are used, in float32 then converted: at GPT-2 124M's shapes the
    step's operands are several GB, which NumPy's float64 draws on the host took over two minutes to make (seen on an
    H200: the first step never came within 150 s)."""
    if xp is np:
        return np.random.default_rng(math.prod(shape)).standard_normal(shape, dtype=np.float32).astype(dtype)
    return xp.random.standard_normal(shape, dtype=np.float32).astype(dtype)


class StepGemms:
    """Every GEMM of one step on random operands of the right shapes; `run()` times them back to back.

    Products of the same shapes share their operands: a step of L identical layers holds one layer's operands, not
    L copies (at SmolLM-135M's shape the copies took about 110 GB of an H200 and left the torch model beside them
    out of memory). CuPy's matmul refuses batched bfloat16 (it takes its integer kernels: "data type 'E' not
    understood"), so those products call cuBLAS's strided-batched GEMM (scripts/measure_gemm.py) on contiguous
    operands, after checking it against a float32 product once; where that check fails they are left out, and
    `skipped` says why."""

    def __init__(self, config: GPTConfig, batch: int, length: int, dtype, device: Device) -> None:
        self.products, self.flops, self.device, self.skipped = [], 0.0, device, None
        self._batched_bf16 = None
        shared: dict[tuple, tuple] = {}
        for product in step_gemms(config, batch, length):
            a_shape = product[0]
            if len(a_shape) == 3 and self._needs_cublas(dtype) and not self._cublas_batched_bf16_works(dtype):
                continue
            if product not in shared:
                shared[product] = self._operands(*product, dtype)
            a, b, out = shared[product]
            self.products.append((a, b, out))
            self.flops += 2 * out.size * a.shape[-1]

    def _needs_cublas(self, dtype) -> bool:
        return self.device.xp is not np and np.dtype(dtype) == np.dtype(dtype_named("bfloat16"))

    def _cublas_batched_bf16_works(self, dtype) -> bool:
        if self._batched_bf16 is None:
            from measure_gemm import BATCHED_BF16_TOLERANCE, batched_bf16_gemm, check_batched_bf16_gemm

            try:
                error = check_batched_bf16_gemm(self.device.xp, np.dtype(dtype))
                reason = None if error < BATCHED_BF16_TOLERANCE else f"differs from float32 by {error:.2g}"
            except Exception as failure:  # no cuBLAS binding (the CuPy double), or one that changed
                first_line = str(failure).splitlines()[0] if str(failure) else ""
                reason = f"cuBLAS's strided-batched GEMM unavailable ({type(failure).__name__}: {first_line})"
            self._batched_bf16 = batched_bf16_gemm if reason is None else False
            if reason is not None:
                self.skipped = f"the batched bfloat16 (attention) products are not timed: {reason}"
        return self._batched_bf16 is not False

    def _operands(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...], transpose_a: bool, transpose_b: bool,
                  dtype) -> tuple[Any, Any, Any]:
        xp = self.device.xp
        a, b = random_operand(xp, a_shape, dtype), random_operand(xp, b_shape, dtype)
        a = xp.swapaxes(a, -1, -2) if transpose_a else a
        b = xp.swapaxes(b, -1, -2) if transpose_b else b
        if a.ndim == 3 and self._needs_cublas(dtype):  # batched_bf16_gemm multiplies row-major operands
            a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
        out = xp.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype)
        return a, b, out

    def run(self) -> float:
        self.device.sync()
        start = time.perf_counter()
        for a, b, out in self.products:
            if a.ndim == 3 and self._batched_bf16:
                self._batched_bf16(self.device.xp, a, b, out)
            else:
                self.device.xp.matmul(a, b, out=out)
        self.device.sync()
        return time.perf_counter() - start


PRESETS = {"gpt2-124m": {"model": "gpt2", "layers": 12, "embd": 768, "heads": 12, "seq": 1024, "vocab": 50257},
           "smollm-135m": {"model": "llama", "layers": 30, "embd": 576, "heads": 9, "kv_heads": 3, "ffn_hidden": 1536,
                           "seq": 1024, "vocab": 49152}}
FIRST_LOSS_TOLERANCE = {"float32": 1e-4, "float64": 1e-6, "tf32": 1e-2, "bfloat16": 1e-3}
FIRST_GRADIENT_TOLERANCE = {"float32": 1e-3, "float64": 1e-4, "tf32": 1e-1, "bfloat16": 5e-2}
"""Relative differences allowed between the two first-step losses, and between their gradients tensor by tensor
(‖ours − theirs‖ / ‖theirs‖): one computation up to rounding (measured: ~1e-7 and ~5e-7 in float32). The loss
alone hardly sees some weights at initialization (near-uniform attention ignores K); the gradients do. float64 is
held to float32-like bounds because transformers computes RMSNorm's statistics and RoPE's angles in float32."""


def precision_of(args: argparse.Namespace) -> str:
    """The precision of the matrix products: bfloat16 (mixed), TF32, or --dtype's."""
    return args.compute_dtype or ("tf32" if args.tf32 else args.dtype)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama", "both"), default="both",
                        help="which comparison: GPT-2 vs a torch GPT-2, llama vs transformers' LlamaForCausalLM")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="llama: KV heads (grouped-query attention)")
    parser.add_argument("--ffn-hidden", type=int, default=0,
                        help="llama: SwiGLU width [0: 8/3·embd rounded up to a multiple of 64]")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of NumPy's BLAS and of torch (read from the command line before NumPy loads)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--compute-dtype", choices=("bfloat16",), default=None,
                        help="mixed precision: ours computes in bfloat16 over --dtype masters (train --compute-dtype), "
                             "torch under autocast(bfloat16) [default: --dtype throughout]")
    parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="AdamW's, on ≥2-D weights only")
    parser.add_argument("--show-losses", type=int, default=5, help="print both losses for this many first steps")
    parser.add_argument("--torch-attention", choices=("sdpa", "matmul"), default="sdpa",
                        help="GPT-2 reference: F.scaled_dot_product_attention(is_causal=True) or explicit matmul + "
                             "masked softmax")
    parser.add_argument("--hf-attention", choices=("eager", "sdpa"), default="eager",
                        help="llama reference: transformers' attn_implementation")
    parser.add_argument("--torch-optimizer", choices=("fused", "foreach", "loop"), default="fused")
    parser.add_argument("--no-torch", action="store_true", help="time ours alone")
    parser.add_argument("--profile", action="store_true", help="also time each of our layers (separate steps)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: ours on CuPy, torch on CUDA, on the same GPU")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="model and shape (flags given explicitly override its values)")
    parser.add_argument("--tf32", action="store_true", help="GPU: TF32 matrix products in both (CUPY_TF32=1)")
    parser.add_argument("--query-block", type=int, default=QUERY_BLOCK,
                        help="our attention's query block (rows per causal block; larger: fewer, bigger GEMMs)")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                        help="our activation recomputation mode (the same numbers, more compute, less memory)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak for MFU [default: looked up by GPU name for float32 or TF32]")
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:  # the preset's values become the defaults, so explicit flags still win
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    if args.threads != THREADS:
        parser.error(f"--threads {args.threads}: give it on the command line (read before NumPy loads its BLAS); "
                     f"this process runs {THREADS}")
    return args


def model_config(args: argparse.Namespace, family: str) -> GPTConfig:
    shape = {"vocab_size": args.vocab, "n_positions": args.seq, "n_embd": args.embd, "n_layer": args.layers,
             "n_head": args.heads}
    if family == "gpt2":
        return GPTConfig(**shape)
    return GPTConfig(arch="llama", n_kv_head=args.kv_heads, ffn_hidden=args.ffn_hidden, tie_embeddings=False,
                     **shape)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    keep_freed_memory()  # as `mpiparallel train` does; torch allocates through the same malloc
    if args.tf32:
        os.environ["CUPY_TF32"] = "1"  # read by CuPy when it runs a float32 matrix product
    device = Device(args.device, args.tf32)
    families = ("gpt2", "llama") if args.model == "both" else (args.model,)
    try:
        results = [compare(args, device, family) for family in families]
    except FirstStepMismatch as error:
        sys.exit(str(error))
    if len(results) > 1:
        print("\nsummary (tokens/s, median after warmup; per-step: the median of the steps' own ratios, each ours "
              "beside the reference step right after it)")
        for result in results:
            print(result)


class FirstStepMismatch(Exception):
    """The two implementations' first losses differ: they do not compute the same thing, timings are moot."""


class Result:
    """One comparison's figures, printed as a summary line."""

    def __init__(self, family: str, reference: str, ours: float, theirs: float | None, step_ratio: float | None,
                 bound_share: float) -> None:
        self.family, self.reference, self.ours, self.theirs = family, reference, ours, theirs
        self.step_ratio, self.bound_share = step_ratio, bound_share

    def __str__(self) -> str:
        line = f"  {self.family:6s} ours {self.ours:9.0f}"
        if self.theirs is not None:
            line += (f"   {self.reference:>12s} {self.theirs:9.0f}   ratio ours/theirs {self.ours / self.theirs:.3f} "
                     f"(per-step {self.step_ratio:.3f})")
        return line + f"   matmul-bound share of our step {self.bound_share:.0%}"


def compare(args: argparse.Namespace, device: Device, family: str) -> Result:
    """One model against its PyTorch twin: build both, alternate their steps, report; profile ours if asked."""
    with tempfile.TemporaryDirectory(prefix="bench_train_") as directory:  # transformers reads our weights here
        return _compare(args, device, family, directory)


def _compare(args: argparse.Namespace, device: Device, family: str, directory: str) -> Result:
    dtype = np.dtype(args.dtype)
    config = model_config(args, family)
    data = byte_batches(args.batch, args.seq) % args.vocab
    ours, ours_optimizer = build_ours(config, dtype, device.xp, args.query_block, args.recompute, args.weight_decay,
                                      args.compute_dtype)
    use_torch = torch is not None and not args.no_torch and device.torch_device is not None
    if use_torch and family == "llama":
        theirs, theirs_optimizer = build_transformers(ours, directory, args.hf_attention, args.torch_optimizer,
                                                      device.torch_device, args.weight_decay)
    elif use_torch:
        theirs, theirs_optimizer = build_torch(ours, args.torch_attention, args.torch_optimizer, device.torch_device,
                                               args.weight_decay)
    reference = "transformers" if family == "llama" else "torch"
    print_header(args, device, config, ours_optimizer, use_torch)

    # on a GPU the bare GEMMs run at the compute dtype (cuBLAS); NumPy has no bfloat16 BLAS: ours multiplies
    # bfloat16-rounded operands in float32 there, so the CPU reference rate stays float32's
    narrow = args.compute_dtype is not None and args.device == "gpu"
    gemms = StepGemms(config, args.batch, args.seq, dtype_named(args.compute_dtype) if narrow else dtype, device)
    ours_times, theirs_times, gemm_times = [], [], []
    ours_faults, theirs_faults = [], []  # page faults a step: fresh pages the kernel zeroes (models.host_memory)
    max_difference = 0.0
    for step in range(args.warmup + args.steps):  # ours, torch and the bare GEMMs take turns: noise hits all alike
        tokens, targets = window(data, step, args.batch, args.seq)
        device.sync()
        start, faults = time.perf_counter(), page_faults()
        ours_loss = ours_step(ours, ours_optimizer, tokens, targets)
        device.sync()
        ours_times.append(time.perf_counter() - start)
        ours_faults.append(page_faults() - faults)
        line = f"step {step:3d}  ours loss {ours_loss:.6f}"
        if use_torch:
            torch_tokens = torch.from_numpy(tokens).to(device.torch_device)
            torch_targets = torch.from_numpy(targets).to(device.torch_device)
            device.sync()
            start, faults = time.perf_counter(), page_faults()
            theirs_loss = torch_step(theirs, theirs_optimizer, torch_tokens, torch_targets,
                                     bfloat16=args.compute_dtype == "bfloat16")
            device.sync()
            theirs_times.append(time.perf_counter() - start)
            theirs_faults.append(page_faults() - faults)
            max_difference = max(max_difference, abs(ours_loss - theirs_loss))
            line += f"  {reference} loss {theirs_loss:.6f}  |Δ| {abs(ours_loss - theirs_loss):.2e}"
            if step == 0:
                check_first_step(args, ours_loss, theirs_loss, ours, theirs, reference)
        gemm_times.append(gemms.run())
        if step < args.show_losses:
            print(line)

    def median_after_warmup(times: list[float]) -> float:
        return statistics.median(times[args.warmup:])

    tokens_per_step = args.batch * args.seq
    ours_seconds, gemm_seconds = median_after_warmup(ours_times), median_after_warmup(gemm_times)
    flops = model_flops(config, args.batch, args.seq)
    rate = gemms.flops / gemm_seconds
    bound = flops / rate
    print(f"\nmodel FLOPs per step: {flops / 1e9:.2f} GFLOP (6·N·tokens + 12·L·T·C·tokens, N = "
          f"{matmul_parameters(config) / 1e6:.2f} M)")
    gemm_library = f"NumPy {THREADS}-thread" if args.device == "cpu" else "CuPy"
    print(f"{gemm_library} GEMM rate on this step's {len(gemms.products)} matrix products: {rate / 1e9:.1f} "
          f"GFLOP/s -> matmul-bound step (model FLOPs / rate) {bound * 1e3:.1f} ms")
    if gemms.skipped:
        print(f"  ({gemms.skipped}; the rate is the other products')")
    print(f"ours : {tokens_per_step / ours_seconds:9.0f} tokens/s  ({ours_seconds * 1e3:.1f} ms/step, median of "
          f"{args.steps}; matmul-bound time is {bound / ours_seconds:.0%} of it, {flops / ours_seconds / 1e9:.1f} "
          f"GFLOP/s)")
    theirs_seconds = step_ratio = None
    if use_torch:
        theirs_seconds = median_after_warmup(theirs_times)
        print(f"{reference}: {tokens_per_step / theirs_seconds:9.0f} tokens/s  ({theirs_seconds * 1e3:.1f} ms/step; "
              f"matmul-bound time is {bound / theirs_seconds:.0%} of it, {flops / theirs_seconds / 1e9:.1f} GFLOP/s)")
        step_ratios = [theirs / ours for ours, theirs in zip(ours_times, theirs_times, strict=True)]
        step_ratio = median_after_warmup(step_ratios)
        print(f"ratio ours/{reference} (tokens/s): {theirs_seconds / ours_seconds:.3f} (median of per-step ratios "
              f"{step_ratio:.3f})")
        print(f"largest loss difference over {len(ours_times)} steps: {max_difference:.2e}")
    print(f"page faults per step (median): ours {median_after_warmup(ours_faults):.0f}"
          + (f", {reference} {median_after_warmup(theirs_faults):.0f}" if use_torch else ""))
    if args.device == "gpu":
        report_mfu(flops, ours_seconds, theirs_seconds,
                   peak_tflops(device, precision_of(args), args.peak_tflops))
    if args.profile:
        profile_both(args, device, ours, ours_optimizer, theirs if use_torch else None,
                     theirs_optimizer if use_torch else None, data, reference)
    theirs_rate = None if theirs_seconds is None else tokens_per_step / theirs_seconds
    return Result(family, reference, tokens_per_step / ours_seconds, theirs_rate, step_ratio, bound / ours_seconds)


def print_header(args: argparse.Namespace, device: Device, config: GPTConfig, ours_optimizer, use_torch: bool) -> None:
    optimizer_name = "mpiparallel.optim.AdamW" if type(ours_optimizer) is not AdamW else "the script's AdamW"
    library = f"NumPy {np.__version__}" if args.device == "cpu" else f"CuPy {device.xp.__version__}"
    if config.is_llama:
        shape = (f"llama {config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads of {config.head_dim} "
                 f"/ {config.kv_heads} KV heads, SwiGLU {config.ffn_width}, untied head")
        reference = (f", transformers {transformers_version()} LlamaForCausalLM (attention {args.hf_attention}, "
                     f"AdamW {args.torch_optimizer}) on torch {torch.__version__}" if use_torch else "")
    else:
        shape = f"GPT-2 {config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads"
        reference = (f", torch {torch.__version__} (attention {args.torch_attention}, AdamW {args.torch_optimizer})"
                     if use_torch else "")
    if not use_torch:
        reference = " (torch not " + ("used)" if torch is not None else "installed)")
    compute = f" ({args.compute_dtype} compute)" if args.compute_dtype else ""
    if args.device == "cpu":
        print("\n" + "\n".join(profile_step.machine_lines(torch if use_torch else None)))
    print(f"\n{shape}, T={args.seq}, B={args.batch}, vocab {args.vocab}, {args.dtype}{compute}"
          f"{', TF32' if args.tf32 else ''}, "
          f"{device.name()}; {library} (query block {args.query_block}, recompute {args.recompute}) "
          f"({optimizer_name}, weight decay {args.weight_decay}){reference}")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_first_step(args: argparse.Namespace, ours_loss: float, theirs_loss: float, ours: Transformer, theirs,
                     reference: str) -> None:
    """Stop unless the first step's losses and every gradient agree: the comparison must be of one computation."""
    precision = precision_of(args)
    loss_difference = abs(ours_loss - theirs_loss) / max(abs(theirs_loss), 1e-30)
    theirs_gradients = theirs.gradients()
    gradient_differences = {name: relative_difference(to_host(param.grad), theirs_gradients[name])
                            for name, param in ours.params.items()}
    worst = max(gradient_differences, key=gradient_differences.get)
    agree = (loss_difference <= FIRST_LOSS_TOLERANCE[precision]
             and gradient_differences[worst] <= FIRST_GRADIENT_TOLERANCE[precision])
    message = (f"first step {'agrees' if agree else 'DIFFERS'}: loss ours {ours_loss:.7f}, {reference} "
               f"{theirs_loss:.7f}, relative difference {loss_difference:.1e} (tolerance "
               f"{FIRST_LOSS_TOLERANCE[precision]:.0e}); gradients of {len(gradient_differences)} tensors, largest "
               f"relative difference {gradient_differences[worst]:.1e} ({worst}; tolerance "
               f"{FIRST_GRADIENT_TOLERANCE[precision]:.0e})")
    if not agree:
        raise FirstStepMismatch(message + ": the two do not compute the same thing, so their timings are not "
                                          "compared")
    print(message)


def relative_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    """‖ours − theirs‖ / ‖theirs‖ (float64 norms)."""
    theirs = np.asarray(theirs, dtype=np.float64)
    return float(np.linalg.norm(ours.astype(np.float64) - theirs) / max(np.linalg.norm(theirs), 1e-300))


def profile_both(args: argparse.Namespace, device: Device, ours: Transformer, ours_optimizer, theirs,
                 theirs_optimizer, data: np.ndarray, reference: str) -> None:
    """More steps of each, profiled (scripts/profile_step.py's three reports): our layers, both steps by category
    side by side, and the GEMMs alone in both BLAS libraries. torch.profiler's CPU times say nothing of a GPU's, so
    on a GPU only our layers are shown."""
    layers = profile_step.LayerProfile()
    layers.attach(ours, ours_optimizer)
    times = []
    for step in range(args.steps):
        tokens, targets = window(data, step, args.batch, args.seq)
        device.sync()
        start = time.perf_counter()
        ours_step(ours, ours_optimizer, tokens, targets)
        device.sync()
        times.append(time.perf_counter() - start)
    layers.detach()
    step_seconds = sum(times) / len(times)
    layers.report(args.steps, step_seconds)
    if device.kind != "cpu":
        return
    theirs_categories = theirs_with_calls = theirs_seconds = None
    generic = False
    if theirs is not None:
        steps = iter(range(args.steps))

        def theirs_step() -> None:
            tokens, targets = window(data, next(steps), args.batch, args.seq)
            torch_step(theirs, theirs_optimizer, torch.from_numpy(tokens), torch.from_numpy(targets),
                       bfloat16=args.compute_dtype == "bfloat16")

        learned_positions = None if ours.config.is_llama else (args.batch, args.seq, ours.config.n_embd)
        theirs_categories, theirs_with_calls, theirs_seconds, generic = profile_step.torch_categories(
            torch, theirs_step, args.steps, learned_positions)
    config = ours.config
    least = profile_step.least_bytes(config, args.batch, args.seq, np.dtype(args.dtype).itemsize,
                                     block_linears(config))
    profile_step.side_by_side(layers.categories(args.steps, step_seconds), step_seconds, theirs_categories,
                              theirs_seconds, least, reference, generic, theirs_with_calls)
    if theirs is not None:
        blas = profile_step.blas_seconds(torch, step_gemms(config, args.batch, args.seq), np.dtype(args.dtype))
        profile_step.blas_bound(*blas, theirs_categories, theirs_seconds)


def report_mfu(flops: float, ours_seconds: float, theirs_seconds: float | None, peak: float | None) -> None:
    """Model FLOPs utilization: achieved model FLOP/s over the GPU's dense peak for the precision used."""
    if peak is None:
        print("MFU: unknown peak for this GPU and precision; give --peak-tflops")
        return
    line = f"MFU (peak {peak:.1f} TFLOP/s): ours {flops / ours_seconds / 1e12 / peak:.1%}"
    if theirs_seconds is not None:
        line += f", torch {flops / theirs_seconds / 1e12 / peak:.1%}"
    print(line)


if __name__ == "__main__":
    main()
