"""Training speed of our hand-written GPT-2 against PyTorch eager, one thread each, in one run.

Both models start from the same weights (ours, copied into torch), see the same byte batches and take the same
AdamW steps (lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0), so their losses agree step by step; the
steps alternate (ours, torch, ours, …) so machine noise hits both alike. A step is forward + backward +
optimizer update + zeroing the gradients. Reported: the median tokens/s of each after the warmup steps, their
ratio, the model FLOPs per step and how close our step comes to the time the matrix multiplications alone need
at NumPy's measured single-thread GEMM rate.

FLOPs per step (nanoGPT's / PaLM's count): 6·N·tokens + 12·L·T·C·tokens, where N = parameters without the
position embedding (the tied token embedding counts once, as the LM head's GEMM), tokens = B·T, and the second
term is attention's q·kᵀ and p·v (2·2·T·C per token and layer forward, ×3 with backward) over the full T×T
scores, as the convention has it; both implementations actually skip most of the masked half (ours in causal
query blocks, torch's flash SDPA kernel likewise). The matmul-bound time is these FLOPs at the rate NumPy
reaches on this step's GEMM shapes (timed between the steps), so it is the time a step would take if it were
nothing but full-rate matrix products.

    python3 scripts/bench_train.py                         # GPT-2 4 layers, 256 wide, T=128, B=8, byte vocab
    python3 scripts/bench_train.py --layers 2 --steps 10 --profile

torch is only needed for the comparison (`pip install -e '.[interop]'`: the pinned CPU build); without it the
script reports ours alone.

On a GPU (`--device gpu`, needs CuPy; torch on CUDA for the comparison) the same step runs on CuPy arrays against
PyTorch eager on the same GPU, both in float32 with full-precision matrix products unless `--tf32`, and the
report adds MFU: model FLOPs per second over the GPU's peak for that precision (`--peak-tflops`, or a table of
known GPUs). GPT-2 124M as in the GPU issue:

    python3 scripts/bench_train.py --device gpu --preset gpt2-124m --batch 8 --steps 10
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy/torch load BLAS
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.backend import to_host  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from models.layers import QUERY_BLOCK, RECOMPUTE_MODES  # noqa: E402
from mpiparallel.commands.launch import keep_freed_memory  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
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
            return "CPU, 1 thread"
        name = self.xp.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)


# Dense peak TFLOP/s by GPU name fragment and precision (vendor datasheets; SXM boards).
PEAK_TFLOPS = {"H200": {"float32": 67.0, "tf32": 494.7}, "H100": {"float32": 67.0, "tf32": 494.7},
               "A100": {"float32": 19.5, "tf32": 156.0}}


def peak_tflops(device: Device, precision: str, given: float | None) -> float | None:
    if given is not None:
        return given
    name = device.name() if device.kind == "gpu" else ""
    return next((peaks[precision] for fragment, peaks in PEAK_TFLOPS.items() if fragment in name), None)


def build_ours(config: GPTConfig, dtype, xp=np, query_block: int = QUERY_BLOCK,
               recompute: str = "none") -> tuple[GPT, object]:
    """Our model and optimizer: mpiparallel.optim.AdamW when the package has it, else the inline one above."""
    model = GPT(config, seed=0, dtype=dtype, xp=xp, query_block=query_block, recompute=recompute)
    try:
        from mpiparallel.optim import AdamW as ProjectAdamW
    except ImportError:
        return model, AdamW(model.parameters())
    return model, ProjectAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def ours_step(model: GPT, optimizer, tokens: np.ndarray, targets: np.ndarray) -> float:
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

        def __init__(self, ours: GPT, attention: str, device: str = "cpu") -> None:
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
                    value = torch.from_numpy(np.ascontiguousarray(to_host(ours.params[ours_name].data)))
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

        def forward(self, tokens, targets):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(positions)
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied LM head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def build_torch(ours: GPT, attention: str, optimizer: str, device: str = "cpu"):
        model = TorchGPT(ours, attention, device)
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[optimizer]
        return model, torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                        **kind)

    def torch_step(model, optimizer, tokens, targets) -> float:
        optimizer.zero_grad(set_to_none=False)  # like ours: gradients live in buffers zeroed each step
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.item()


def model_flops(config: GPTConfig, batch: int, length: int) -> float:
    n = config.parameter_count() - config.n_positions * config.n_embd
    tokens = batch * length
    return 6 * n * tokens + 12 * config.n_layer * length * config.n_embd * tokens


def step_gemms(config: GPTConfig, batch: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...], bool, bool]]:
    """Every matrix product of one training step: (a shape, b shape, transpose a, transpose b), as the layers
    compute them (forward, d(input), d(weight) of each Linear; the attention products batched over B·H)."""
    m, c, heads, d = batch * length, config.n_embd, batch * config.n_head, config.n_embd // config.n_head
    gemms = []
    for k, n in ((c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)):
        gemms += [((m, k), (k, n), False, False), ((m, n), (k, n), False, True), ((m, k), (m, n), True, False)]
    attention = [((heads, length, d), (heads, length, d), False, True),      # q·kᵀ
                 ((heads, length, length), (heads, length, d), False, False),  # p·v
                 ((heads, length, d), (heads, length, d), False, True),      # dp = dy·vᵀ
                 ((heads, length, length), (heads, length, d), True, False),  # dv = pᵀ·dy
                 ((heads, length, length), (heads, length, d), False, False),  # dq = ds·k
                 ((heads, length, length), (heads, length, d), True, False)]  # dk = dsᵀ·q
    vocab = config.vocab_size
    head = [((m, c), (vocab, c), False, True),  # logits = x·wteᵀ
            ((m, vocab), (vocab, c), False, False),  # dx = dlogits·wte
            ((m, vocab), (m, c), True, False)]  # dwte = dlogitsᵀ·x
    return gemms * config.n_layer + attention * config.n_layer + head


class StepGemms:
    """Every GEMM of one step on random operands of the right shapes; `run()` times them back to back."""

    def __init__(self, config: GPTConfig, batch: int, length: int, dtype, device: Device) -> None:
        rng, xp = np.random.default_rng(0), device.xp
        self.operands, self.flops, self.device = [], 0.0, device
        for a_shape, b_shape, transpose_a, transpose_b in step_gemms(config, batch, length):
            a, b = rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)
            a = xp.swapaxes(xp.asarray(a), -1, -2) if transpose_a else xp.asarray(a)
            b = xp.swapaxes(xp.asarray(b), -1, -2) if transpose_b else xp.asarray(b)
            out = xp.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype)
            self.operands.append((a, b, out))
            self.flops += 2 * out.size * a.shape[-1]

    def run(self) -> float:
        self.device.sync()
        start = time.perf_counter()
        for a, b, out in self.operands:
            self.device.xp.matmul(a, b, out=out)
        self.device.sync()
        return time.perf_counter() - start


class LayerProfile:
    """Exclusive wall time per (layer kind, phase), by wrapping the forward/backward methods of every layer."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], float] = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, obj, label: str) -> None:
        for phase in ("forward", "backward", "backward_input", "backward_weights"):
            method = getattr(obj, phase, None)
            if method is not None:
                setattr(obj, phase, self._timed(method, label, "forward" if phase == "forward" else "backward"))

    def _timed(self, method, label: str, phase: str):
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[0]
                self.stack.pop()
                self.totals[label, phase] += elapsed - frame[1]
                if self.stack:
                    self.stack[-1][1] += elapsed
        return timed

    def attach(self, model: GPT) -> None:
        self.wrap(model.embedding, "embedding")
        self.wrap(model.head.ln_f, "layernorm")
        self.wrap(model.head.loss, "lm head + cross-entropy")
        for block in model.blocks:
            self.wrap(block, "residual adds")
            for ln in (block.ln_1, block.ln_2):
                self.wrap(ln, "layernorm")
            self.wrap(block.attn, "attention core (qkᵀ, softmax, pv)")
            self.wrap(block.attn.qkv, "linear qkv")
            self.wrap(block.attn.projection, "linear attn proj")
            self.wrap(block.mlp, "mlp glue")
            self.wrap(block.mlp.expand, "linear mlp fc")
            self.wrap(block.mlp.activation, "gelu")
            self.wrap(block.mlp.contract, "linear mlp proj")

    def report(self, steps: int, step_seconds: float) -> None:
        labels = sorted({label for label, _ in self.totals}, key=lambda k: -sum(self.totals[k, p]
                                                                                for p in ("forward", "backward")))
        print(f"\nprofile of our step (exclusive ms per step, {steps} steps; step {step_seconds * 1e3:.1f} ms)")
        print(f"{'layer':38s} {'forward':>9s} {'backward':>9s} {'share':>7s}")
        for label in labels:
            forward, backward = (self.totals[label, p] / steps for p in ("forward", "backward"))
            print(f"{label:38s} {forward * 1e3:9.2f} {backward * 1e3:9.2f} {(forward + backward) / step_seconds:7.1%}")
        covered = sum(self.totals.values()) / steps
        print(f"{'optimizer + zero_grad + rest':38s} {'':9s} {'':9s} {1 - covered / step_seconds:7.1%}")


PRESETS = {"gpt2-124m": {"layers": 12, "embd": 768, "heads": 12, "seq": 1024, "vocab": 50257}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--show-losses", type=int, default=5, help="print both losses for this many first steps")
    parser.add_argument("--torch-attention", choices=("sdpa", "matmul"), default="sdpa",
                        help="F.scaled_dot_product_attention(is_causal=True) or explicit matmul + masked softmax")
    parser.add_argument("--torch-optimizer", choices=("fused", "foreach", "loop"), default="fused")
    parser.add_argument("--no-torch", action="store_true", help="time ours alone")
    parser.add_argument("--profile", action="store_true", help="also time each of our layers (separate steps)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: ours on CuPy, torch on CUDA, on the same GPU")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model shape (overrides --layers ... --vocab)")
    parser.add_argument("--tf32", action="store_true", help="GPU: TF32 matrix products in both (CUPY_TF32=1)")
    parser.add_argument("--query-block", type=int, default=QUERY_BLOCK,
                        help="our attention's query block (rows per causal block; larger: fewer, bigger GEMMs)")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                        help="our activation recomputation mode (the same numbers, more compute, less memory)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak for MFU [default: looked up by GPU name for float32 or TF32]")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as `mpiparallel train` does; torch allocates through the same malloc
    for name, value in PRESETS.get(args.preset, {}).items():
        setattr(args, name, value)
    if args.tf32:
        os.environ["CUPY_TF32"] = "1"  # read by CuPy when it runs a float32 matrix product
    device = Device(args.device, args.tf32)

    dtype = np.dtype(args.dtype)
    config = GPTConfig(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                       n_head=args.heads)
    data = byte_batches(args.batch, args.seq) % args.vocab
    ours, ours_optimizer = build_ours(config, dtype, device.xp, args.query_block, args.recompute)
    use_torch = torch is not None and not args.no_torch and device.torch_device is not None
    if use_torch:
        theirs, theirs_optimizer = build_torch(ours, args.torch_attention, args.torch_optimizer, device.torch_device)
    tokens_per_step = args.batch * args.seq
    optimizer_name = "mpiparallel.optim.AdamW" if type(ours_optimizer) is not AdamW else "the script's AdamW"
    library = f"NumPy {np.__version__}" if args.device == "cpu" else f"CuPy {device.xp.__version__}"
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, {args.heads} heads, T={args.seq}, B={args.batch}, "
          f"vocab {args.vocab}, {args.dtype}{', TF32' if args.tf32 else ''}, {device.name()}; {library} "
          f"(query block {args.query_block}, recompute {args.recompute}) "
          f"({optimizer_name})"
          + (f", torch {torch.__version__} (attention {args.torch_attention}, AdamW {args.torch_optimizer})"
             if use_torch else " (torch not " + ("used)" if torch is not None else "installed)")))

    gemms = StepGemms(config, args.batch, args.seq, dtype, device)
    ours_times, theirs_times, gemm_times = [], [], []
    max_difference = 0.0
    for step in range(args.warmup + args.steps):  # ours, torch and the bare GEMMs take turns: noise hits all alike
        tokens, targets = window(data, step, args.batch, args.seq)
        device.sync()
        start = time.perf_counter()
        ours_loss = ours_step(ours, ours_optimizer, tokens, targets)
        device.sync()
        ours_times.append(time.perf_counter() - start)
        line = f"step {step:3d}  ours loss {ours_loss:.6f}"
        if use_torch:
            torch_tokens = torch.from_numpy(tokens).to(device.torch_device)
            torch_targets = torch.from_numpy(targets).to(device.torch_device)
            device.sync()
            start = time.perf_counter()
            theirs_loss = torch_step(theirs, theirs_optimizer, torch_tokens, torch_targets)
            device.sync()
            theirs_times.append(time.perf_counter() - start)
            max_difference = max(max_difference, abs(ours_loss - theirs_loss))
            line += f"  torch loss {theirs_loss:.6f}  |Δ| {abs(ours_loss - theirs_loss):.2e}"
        gemm_times.append(gemms.run())
        if step < args.show_losses:
            print(line)

    def median_after_warmup(times: list[float]) -> float:
        return statistics.median(times[args.warmup:])

    ours_seconds, gemm_seconds = median_after_warmup(ours_times), median_after_warmup(gemm_times)
    flops = model_flops(config, args.batch, args.seq)
    rate = gemms.flops / gemm_seconds
    bound = flops / rate
    print(f"\nmodel FLOPs per step: {flops / 1e9:.2f} GFLOP (6·N·tokens + 12·L·T·C·tokens, N = "
          f"{(config.parameter_count() - config.n_positions * config.n_embd) / 1e6:.2f} M)")
    gemm_library = "NumPy single-thread" if args.device == "cpu" else "CuPy"
    print(f"{gemm_library} GEMM rate on this step's {len(gemms.operands)} matrix products: {rate / 1e9:.1f} "
          f"GFLOP/s -> matmul-bound step (model FLOPs / rate) {bound * 1e3:.1f} ms")
    print(f"ours : {tokens_per_step / ours_seconds:9.0f} tokens/s  ({ours_seconds * 1e3:.1f} ms/step, median of "
          f"{args.steps}; matmul-bound time is {bound / ours_seconds:.0%} of it, {flops / ours_seconds / 1e9:.1f} "
          f"GFLOP/s)")
    if use_torch:
        theirs_seconds = median_after_warmup(theirs_times)
        print(f"torch: {tokens_per_step / theirs_seconds:9.0f} tokens/s  ({theirs_seconds * 1e3:.1f} ms/step; "
              f"matmul-bound time is {bound / theirs_seconds:.0%} of it, {flops / theirs_seconds / 1e9:.1f} GFLOP/s)")
        step_ratios = [theirs / ours for ours, theirs in zip(ours_times, theirs_times, strict=True)]
        print(f"ratio ours/torch (tokens/s): {theirs_seconds / ours_seconds:.3f} (median of per-step ratios "
              f"{median_after_warmup(step_ratios):.3f})")
        print(f"largest loss difference over {len(ours_times)} steps: {max_difference:.2e}")
    if args.device == "gpu":
        report_mfu(flops, ours_seconds, theirs_seconds if use_torch else None,
                   peak_tflops(device, "tf32" if args.tf32 else args.dtype, args.peak_tflops))

    if args.profile:
        profile = LayerProfile()
        profile.attach(ours)
        times = []
        for step in range(args.steps):
            tokens, targets = window(data, step, args.batch, args.seq)
            start = time.perf_counter()
            ours_step(ours, ours_optimizer, tokens, targets)
            times.append(time.perf_counter() - start)
        profile.report(args.steps, sum(times) / len(times))


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
