"""Packed documents (`models.documents`, `train --attention document`): a token attends only to the earlier tokens
of its own document and sits at its position in it.

Oracles, float64: a packed window's loss and every gradient equal its documents run one by one through the serial
model and summed (every family, every recomputation mode, query blocks that skip keys); transformers' own models
given per-document position_ids and a block-diagonal causal mask (SDPA attention) compute the same loss and
gradients (every family); each attention layer's backward against finite differences. The context-parallel layers
with documents are checked in tests/models/test_context_parallel.py, every mesh in tests/runtime/test_composition.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from gradient_checks import RNG, assert_close, numeric_gradient, param, parameters_of
from interop import hugging_face

from models.config import GPTConfig
from models.documents import ONE_DOCUMENT, Documents, attention_scores, document_lengths, skipped_chunk_pairs
from models.layers import CausalSelfAttention, Linear
from models.rotary import RotaryEmbedding
from models.transformer import Transformer
from mpiparallel.checkpoints.hugging_face import load_pretrained, save_pretrained

EOT = 0
TOLERANCE = 1e-9
VOCAB = 61
FAMILIES = {
    "gpt2": GPTConfig(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4),
    "llama": GPTConfig(arch="llama", vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4, n_kv_head=2,
                       ffn_hidden=24, rope_theta=500.0),
    "mixtral": GPTConfig(arch="llama", vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4, n_kv_head=2,
                         ffn_hidden=24, n_experts=4, moe_top_k=2, moe_aux_coef=0.0),
    "deepseek_v3": GPTConfig(arch="deepseek_v3", vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4,
                             q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3,
                             n_experts=4, moe_top_k=2, moe_ffn_hidden=6, n_shared_experts=1,
                             first_k_dense_replace=1, moe_aux_coef=0.0),
}


def packed_window(length: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """Two rows of tokens with end-of-text tokens at chosen places: row 0 opens documents at 0 (its first token),
    5, 6 (a one-token document) and 15; row 1 starts inside a document and opens one at 9 and 20."""
    window = np.random.default_rng(7).integers(1, VOCAB, size=(2, length + 1))
    window[0, [0, 5, 6, 15]] = EOT
    window[1, [9, 20]] = EOT
    return window[:, :-1], window[:, 1:]


def randomized(model: Transformer) -> Transformer:
    """Weights moved away from the initialization, so attention is far from uniform and every path matters."""
    rng = np.random.default_rng(3)
    for parameter in model.parameters():
        parameter.data += 0.1 * rng.standard_normal(parameter.data.shape)
    return model


def loss_and_gradients(config: GPTConfig, inputs, targets, documents=ONE_DOCUMENT, normalizer=None, **settings):
    model = randomized(Transformer(config, seed=1, dtype=np.float64, **settings))
    loss, saved = model.forward(inputs, targets, normalizer=normalizer, documents=documents)
    model.backward(saved)
    return loss, {name: parameter.grad.copy() for name, parameter in model.params.items()}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# -- the documents of a window ---------------------------------------------------------------------------------

def test_each_end_of_text_opens_a_document_and_positions_restart_there():
    documents = Documents.of_tokens(np.array([[5, 0, 3, 4, 0, 0, 7], [0, 1, 2, 3, 4, 5, 6]]), eot_id=0)
    assert documents.starts.tolist() == [[0, 1, 1, 1, 4, 5, 5], [0, 0, 0, 0, 0, 0, 0]]
    assert documents.positions.tolist() == [[0, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert document_lengths(documents.starts[0]) == [1, 3, 1, 2]
    assert documents.first_key(4) == 0 and documents.rows(slice(0, 1)).first_key(4) == 4


def test_the_scores_formula_counts_each_documents_triangle():
    documents = Documents.of_tokens(packed_window()[0], EOT)
    lengths = [document_lengths(row) for row in documents.starts]
    assert lengths == [[5, 1, 9, 9], [9, 11, 4]]
    assert attention_scores(documents, 24) == sum(n * (n + 1) // 2 for row in lengths for n in row)
    assert attention_scores(ONE_DOCUMENT, 24) == 24 * 25 // 2


# -- a packed window equals its documents run one by one -------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("settings", [{}, {"query_block": 3, "recompute": "selective"}, {"recompute": "full"}],
                         ids=["one-block", "blocks-of-3-selective", "full-recompute"])
def test_a_packed_window_equals_its_documents_run_one_by_one(family, settings):
    config = FAMILIES[family]
    inputs, targets = packed_window()
    documents = Documents.of_tokens(inputs, EOT)
    packed, packed_gradients = loss_and_gradients(config, inputs, targets, documents, **settings)
    total, summed = 0.0, None
    for row in range(len(inputs)):
        bounds = [*np.unique(documents.starts[row]).tolist(), inputs.shape[1]]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=False):
            loss, gradients = loss_and_gradients(config, inputs[row:row + 1, start:stop],
                                                 targets[row:row + 1, start:stop], normalizer=inputs.size, **settings)
            total += loss
            summed = gradients if summed is None else {name: summed[name] + g for name, g in gradients.items()}
    assert relative(np.array(packed), np.array(total)) <= TOLERANCE
    assert max(relative(packed_gradients[name], summed[name]) for name in summed) <= TOLERANCE
    causal, _ = loss_and_gradients(config, inputs, targets, **settings)
    assert abs(causal - packed) > 1e-3  # the documents change the numbers: the mask is not a no-op


# -- transformers' own models with per-document positions and a block-diagonal mask ----------------------------

def block_diagonal_mask(torch, documents: Documents):
    """(B, 1, T, T) additive mask: 0 where key j is visible to query i (start_i ≤ j ≤ i), −∞ elsewhere."""
    i = np.arange(documents.length)
    visible = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] >= documents.starts[:, :, None])
    return torch.from_numpy(np.where(visible, 0.0, -np.inf)[:, None])


def transformers_model(torch, transformers, directory: Path, config: GPTConfig):
    """transformers' model of the family from our saved weights, float64, SDPA attention, its float32 islands
    widened as the families' interop tests do."""
    if config.is_deepseek:
        from test_deepseek_interop import load_into_transformers
        return load_into_transformers(torch, transformers, directory, config)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float64, attn_implementation="sdpa",
        **({"experts_implementation": "eager"} if config.n_experts else {})).train()
    if config.is_llama:
        from test_llama_interop import widen_upcasts
        widen_upcasts(torch, transformers, hf_model, config)
    return hf_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_with_document_positions_and_a_block_diagonal_mask_computes_the_same(family):
    """transformers' model (SDPA: its eager attention takes the softmax in float32, 1e-7 from float64) given
    per-document position_ids and the block-diagonal causal mask: the same loss, and the same gradient of every
    parameter — read back through transformers' own save_pretrained (its gradients written as weights) and our
    loader, so its fused expert tensors map to ours as any checkpoint does."""
    torch, transformers = hugging_face()
    config = FAMILIES[family]
    inputs, targets = packed_window()
    documents = Documents.of_tokens(inputs, EOT)
    model = randomized(Transformer(config, seed=1, dtype=np.float64))
    loss, saved = model.forward(inputs, targets, documents=documents)
    model.backward(saved)
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(Path(folder) / "ours", config, model.state_dict())
        hf_model = transformers_model(torch, transformers, Path(folder) / "ours", config)
        logits = hf_model(torch.from_numpy(inputs), attention_mask=block_diagonal_mask(torch, documents),
                          position_ids=torch.from_numpy(documents.positions)).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(targets).reshape(-1))
        hf_loss.backward()
        with torch.no_grad():
            for parameter in hf_model.parameters():
                parameter.copy_(parameter.grad if parameter.grad is not None else torch.zeros_like(parameter))
        hf_model.save_pretrained(str(Path(folder) / "gradients"))
        theirs = load_pretrained(Path(folder) / "gradients")[1]
    assert abs(loss - hf_loss.item()) <= TOLERANCE * abs(hf_loss.item()), (loss, hf_loss.item())
    assert set(theirs) >= set(model.params)
    worst = max(relative(theirs[name], model.params[name].grad) for name in model.params)
    assert worst <= TOLERANCE, worst


# -- each attention layer's backward against finite differences ------------------------------------------------

@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("query_block", [2, 64])
def test_causal_self_attention_with_documents_matches_finite_differences(rope, query_block):
    n_embd, n_head, n_kv = 16, 4, 2
    head_dim = n_embd // n_head
    width = (n_head + 2 * n_kv) * head_dim
    layer = CausalSelfAttention(Linear(param("qkv.w", n_embd, width), param("qkv.b", width)),
                                Linear(param("proj.w", n_embd, n_embd), param("proj.b", n_embd)), n_head,
                                query_block=query_block, n_kv_head=n_kv,
                                rope=RotaryEmbedding(head_dim, 100.0) if rope else None)
    tokens = np.array([[3, 0, 4, 4, 0, 5, 6, 0], [1, 2, 0, 3, 3, 3, 3, 0]])
    documents = Documents.of_tokens(tokens, 0)
    x = RNG.standard_normal((2, 8, n_embd))
    weights = RNG.standard_normal((2, 8, n_embd))

    def loss() -> float:
        return float((layer.forward(x, documents)[0] * weights).sum())

    for parameter in parameters_of(layer):
        parameter.zero_grad()
    out, saved = layer.forward(x, documents)
    dx = layer.backward(saved, weights.copy())
    picks, numeric = numeric_gradient(loss, x)
    assert_close(dx.reshape(-1)[picks], numeric, "input")
    for parameter in parameters_of(layer):
        picks, numeric = numeric_gradient(loss, parameter.data)
        assert_close(parameter.grad.reshape(-1)[picks], numeric, parameter.name)
    # a token's output depends on nothing outside its document: move an earlier document, it stays put
    moved = x.copy()
    moved[0, :1] += 1.0
    np.testing.assert_allclose(layer.forward(moved, documents)[0][0, 1:], out[0, 1:], rtol=1e-12, atol=1e-12)


def test_skipped_chunk_pairs_follow_the_boundaries_between_chunks():
    # cp 2: four chunks of 4 tokens; documents open at 5 and 12 — chunk 2's queries (8…11) start no earlier than
    # 5, past chunk 0; chunk 3's (12…15) start at 12, past chunks 0, 1 and 2
    tokens = np.ones((1, 16), dtype=int)
    tokens[0, [5, 12]] = 0
    documents = Documents.of_tokens(tokens, 0)
    assert skipped_chunk_pairs(documents, 2) == 4
    two_rows = Documents.of_tokens(np.concatenate([tokens, np.ones((1, 16), dtype=int)]), 0)
    assert skipped_chunk_pairs(two_rows, 2) == 0  # a pair is skipped only where every row skips it


def test_attention_computes_only_the_scores_of_each_documents_triangle():
    """One query per block: the serial layer multiplies each query by its document's keys only, so the scores it
    computes are the formula's Σ L(L+1)/2 over the documents (causal attention: T(T+1)/2)."""
    inputs, _ = packed_window()
    layer = CausalSelfAttention(Linear(param("qkv.w", 8, 24)), Linear(param("proj.w", 8, 8)), 2, query_block=1)
    computed, probabilities = [0], CausalSelfAttention._probabilities

    def counting(*args):
        probs = probabilities(*args)
        computed[0] += probs.shape[-1] * probs.shape[-2]
        return probs

    x = RNG.standard_normal((1, inputs.shape[1], 8))
    for row in range(len(inputs)):
        documents = Documents.of_tokens(inputs[row:row + 1], EOT)
        for case in (documents, ONE_DOCUMENT):
            computed[0] = 0
            layer._probabilities = counting
            layer.forward(x, case)
            assert computed[0] == attention_scores(case, inputs.shape[1])
    assert attention_scores(Documents.of_tokens(inputs[:1], EOT), 24) < attention_scores(ONE_DOCUMENT, 24) / 2
