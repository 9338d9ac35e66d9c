"""The model holds no activations: microbatches in flight in any order, weight passes deferred, the model cut into
ranges of units, and activation recomputation — all give the numbers of one plain forward and backward (float64).
The tensor-parallel (+SP) versions of these checks run on several ranks in test_tensor_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest

from models.documents import Documents
from models.layers import block_activation_elements
from models.transformer import GPTConfig, Transformer

CONFIG = GPTConfig(vocab_size=29, n_positions=16, n_embd=16, n_layer=3, n_head=4)
TOLERANCE = 1e-12


def batch(rows: int = 6, length: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    window = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (rows, length + 1))
    return window[:, :-1], window[:, 1:]


def model(**options) -> Transformer:
    built = Transformer(CONFIG, seed=11, dtype=np.float64, **options)
    for param in built.parameters():  # away from the ones/zeros init, so every path carries gradient
        param.data += 0.05 * np.random.default_rng(len(param.name)).standard_normal(param.data.shape)
    return built


def gradients(of: Transformer) -> dict[str, np.ndarray]:
    return {p.name: p.grad.copy() for p in of.parameters()}


def one_at_a_time(of: Transformer, pieces: list[tuple[np.ndarray, np.ndarray]], normalizer: int) -> tuple[float, dict]:
    """The reference: each microbatch's forward immediately followed by its joint backward."""
    of.zero_grad()
    loss = 0.0
    for tokens, targets in pieces:
        piece_loss, saved = of.forward(tokens, targets, normalizer)
        loss += piece_loss
        of.backward(saved)
    return loss, gradients(of)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, value in want.items():
        scale = max(float(np.abs(value).max()), 1e-300)
        assert float(np.abs(got[name] - value).max()) / scale <= TOLERANCE, name


def split(tokens: np.ndarray, targets: np.ndarray, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(zip(np.array_split(tokens, count), np.array_split(targets, count), strict=True))


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("order", ["reverse", "scrambled"])
def test_microbatches_in_flight_with_deferred_weight_passes_equal_one_at_a_time(count, order):
    gpt, (tokens, targets) = model(), batch()
    pieces = split(tokens, targets, count)
    want_loss, want = one_at_a_time(gpt, pieces, tokens.size)
    gpt.zero_grad()
    forwards = [gpt.forward(x, y, tokens.size) for x, y in pieces]  # every microbatch in flight at once
    backward_order = list(reversed(range(count))) if order == "reverse" else [1, 2, 0][:count] if count > 1 else [0]
    for i in backward_order:
        assert gpt.backward_input(forwards[i][1]) is None  # d(token ids): nothing
    assert not any(np.any(p.grad) for p in gpt.parameters())  # no weight pass has run yet
    for i in reversed(backward_order):
        gpt.backward_weights(forwards[i][1])
        assert forwards[i][1].nbytes() == 0  # freed once its last pass has run
    assert sum(loss for loss, _ in forwards) == pytest.approx(want_loss, rel=TOLERANCE)
    assert_same(gradients(gpt), want)


def test_a_weight_pass_may_follow_later_microbatches_input_passes():
    """Zero-bubble order: I(0), F(1), I(1), W(0), W(1) — each W long after its I, with another microbatch between."""
    gpt, (tokens, targets) = model(), batch()
    pieces = split(tokens, targets, 2)
    _, want = one_at_a_time(gpt, pieces, tokens.size)
    gpt.zero_grad()
    first = gpt.forward(*pieces[0], tokens.size)[1]
    gpt.backward_input(first)
    second = gpt.forward(*pieces[1], tokens.size)[1]
    gpt.backward_input(second)
    gpt.backward_weights(first)
    gpt.backward_weights(second)
    assert_same(gradients(gpt), want)


@pytest.mark.parametrize("cut", [1, 2, 4])  # after the embedding, after a block, before the head
def test_running_two_ranges_with_the_boundary_activation_handed_over_equals_the_whole_model(cut):
    gpt, (tokens, targets) = model(), batch()
    want_loss, want = one_at_a_time(gpt, [(tokens, targets)], tokens.size)
    gpt.zero_grad()
    boundary, first = gpt.forward(tokens, units=range(0, cut))
    assert boundary.shape == (*tokens.shape, CONFIG.n_embd)
    loss, second = gpt.forward(boundary.copy(), targets, units=range(cut, gpt.unit_count))
    dboundary = gpt.backward(second)
    assert dboundary.shape == boundary.shape
    assert gpt.backward(first, dboundary.copy()) is None
    assert loss == pytest.approx(want_loss, rel=TOLERANCE)
    assert_same(gradients(gpt), want)


def test_the_head_range_needs_targets():
    gpt, (tokens, _) = model(), batch()
    with pytest.raises(ValueError, match="targets"):
        gpt.forward(tokens)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_numbers_of_none(mode):
    tokens, targets = batch()
    pieces = split(tokens, targets, 2)
    want_loss, want = one_at_a_time(model(), pieces, tokens.size)
    got_loss, got = one_at_a_time(model(recompute=mode), pieces, tokens.size)
    assert got_loss == pytest.approx(want_loss, rel=TOLERANCE)
    assert_same(got, want)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("query_block, length", [(4, 10), (64, 12)])
def test_saved_bytes_per_block_equal_the_formula(mode, query_block, length):
    tokens, targets = batch(rows=3, length=length)
    gpt = model(recompute=mode, query_block=query_block)
    _, saved = gpt.forward(tokens, targets)
    expected = block_activation_elements(3, length, CONFIG.n_embd, CONFIG.n_head, recompute=mode,
                                         query_block=query_block) * 8
    for block in range(1, CONFIG.n_layer + 1):
        assert saved.per_unit[block].nbytes() == expected
    gpt.backward(saved)
    assert saved.nbytes() == 0


@pytest.mark.parametrize("query_block, fewer", [(3, True), (64, False)])  # one block of 12: its first key is 0
def test_with_packed_documents_a_block_keeps_fewer_probabilities_and_the_formula_counts_them(query_block, fewer):
    tokens, targets = batch(rows=3, length=12)
    tokens = np.where(tokens == 0, 1, tokens)
    tokens[0, [4, 9]], tokens[2, 6] = 0, 0  # rows 0 and 2 hold several documents, row 1 one
    documents = Documents.of_tokens(tokens, 0)
    _, saved = model(query_block=query_block).forward(tokens, targets, documents=documents)
    expected = block_activation_elements(3, 12, CONFIG.n_embd, CONFIG.n_head, query_block=query_block,
                                         documents=documents) * 8
    causal = block_activation_elements(3, 12, CONFIG.n_embd, CONFIG.n_head, query_block=query_block) * 8
    assert saved.per_unit[1].nbytes() == expected and (expected < causal) == fewer


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_a_llama_blocks_saved_bytes_equal_the_formula(mode, kv_heads):
    config = GPTConfig(arch="llama", vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=4,
                       n_kv_head=kv_heads, ffn_hidden=24)
    tokens, targets = batch(rows=3, length=10)
    llama = Transformer(config, dtype=np.float64, recompute=mode, query_block=4)
    _, saved = llama.forward(tokens, targets)
    expected = 8 * block_activation_elements(3, 10, 16, 4, recompute=mode, query_block=4, kv_heads=kv_heads,
                                             ffn_hidden=24)
    assert [saved.per_unit[block].nbytes() for block in (1, 2)] == [expected, expected]


def test_recomputation_saves_what_it_promises():
    """selective drops exactly the s² probabilities; full keeps one activation per block."""
    b, s, h, a = 3, 10, CONFIG.n_embd, CONFIG.n_head
    none, selective, full = (block_activation_elements(b, s, h, a, recompute=m, query_block=4)
                             for m in ("none", "selective", "full"))
    assert none - selective == b * a * sum((stop - start) * stop for start, stop in [(0, 4), (4, 8), (8, 10)])
    assert full == b * s * h
    with pytest.raises(ValueError, match="recompute"):
        block_activation_elements(b, s, h, a, recompute="some")
    with pytest.raises(ValueError, match="recompute"):
        Transformer(CONFIG, recompute="some")
