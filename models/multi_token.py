"""Multi-token prediction (MTP, DeepSeek-V3 §2.2): D modules after the main model, module k predicting the token
k + 1 ahead, their losses added to the main loss with weight λ/D.

For a sequence t_0 … t_T (inputs t_0 … t_{T−1}, targets t_1 … t_T) and h⁰ the main model's last block output
(before the final norm), module k = 1 … D over the positions i = 0 … T − 1 − k:

    z_i^k   = eh_proj([enorm(Emb(t_{i+k})) | hnorm(h_i^{k−1})])     eh_proj [2h, h]; Emb the shared embedding
    h^k     = Block_k(z^k)                                          a causal block
    loss_k  = mean over the batch and i of CE(head(norm_k(h_i^k)), t_{i+k+1})     the shared output head,
                                                                                   its own final norm
    loss    = main loss + λ/D · Σ_k loss_k

(the order [embedding | hidden] is that of DeepSeek's checkpoint, and of transformers' `MtpLayer` and vLLM that
read it). The loss of each module is a mean over its own B·(T − k) predictions: the cross-entropy's normalizer is
the main one × (T − k)/T × D/λ, so microbatches and data-parallel ranks still add up to the global objective.

Every module runs over all T positions, as the main blocks do, the last k masked (Megatron-LM's MTP does the
same): position i ≥ T − k embeds a token past the end (id 0 in its place) and predicts nothing (target
`IGNORED`: no loss, no gradient). The block is causal, so the masked positions, all at the end, change nothing
at the T − k positions before them, and no gradient reaches them (every loss that could see them is masked): the
numbers are those of the modules run on T − k positions. Running the full length is what lets the modules cut
the sequence as the main model does:

- Sequence parallelism (Megatron SP, inside TP): the head unit receives this TP rank's slice of the positions.
  The shifted token ids (B, T) are known to every rank, so the vocab-parallel embedding of them reduce-scatters
  straight to the slice (as the main embedding does); enorm, hnorm, eh_proj and the final norm run on the slice
  (eh_proj is replicated: 2h² weights, no communication, where Megatron's column-parallel eh_proj all-gathers its
  2h-wide input and its output columns); the block enters and leaves the group as a main block; the vocab-parallel
  cross-entropy all-gathers the slices as the main head does. The replicated weights' gradients are then partial
  sums over tp (placement `Partial`), summed once per step with the LayerNorms'.
- Context parallelism (zigzag: each CP rank holds chunks r and 2·cp − 1 − r of every sequence): a chunk's last
  positions embed and predict tokens of the next chunk, held by another CP rank. A context-parallel model is
  handed only its chunks' targets (its contract, which the trainer, the pipeline executor, evaluation and the
  tests all keep), so the head all-gathers the CP group's targets once per microbatch and puts the whole
  sequences back together: (cp − 1)/cp·b·s token ids sent per rank, 8 bytes a token — against the (r + d_r)·e
  bytes a token (1,152 in DeepSeek-V3 at bfloat16) that each MLA block's context parallelism gathers — whatever
  D and the chunk length. Each module then cuts its shifted ids and targets to this rank's chunks; the mask
  covers the last k positions of the whole sequence (on the rank holding the last chunk), not of each chunk.
  Taking the next tokens from the batch, which every rank reads whole, would send nothing, but every caller
  would then have to build a second layout of `targets` under CP (the chunks plus the D tokens after each) —
  to save a message that one block's latent gather outweighs 144 times. The shared embedding's gradient from a
  shifted token lands in that token's row on the rank that embedded it; wte is replicated over cp (and dp) and
  its gradient summed over them with every other parameter's, so each row gets the sum over all positions.

Backward runs the modules last to first: d(h^k) is its head's gradient plus module k + 1's through hnorm, and
d(h⁰) adds module 1's to the main head's. The shared embedding and head weights receive every module's gradient.
Same protocol as `models.layers` (split backward included), held by the model as its head unit, so it runs on the
last pipeline stage. The modules' MoE blocks choose with no selection bias and add no balance loss (their routing
statistics do not feed the aux-loss-free balancing); the masked positions are routed like the others (with a
capacity factor they count among the tokens). Communication: that of the layers it holds (tensor- and
context-parallel ones under TP, SP and CP), and under CP the targets' all-gather above.
"""

from __future__ import annotations

from typing import Any

from collectives.backend import Array, get_array_module

from .axis import ContextAxis
from .layers import IGNORED, Layer, LMHead, Saved


class PredictionModule:
    """One MTP module's layers: enorm, hnorm, eh_proj, the block, its final norm and the shared cross-entropy."""

    def __init__(self, enorm: Any, hnorm: Any, projection: Any, block: Any, norm: Any, cross_entropy: Any) -> None:
        self.enorm, self.hnorm, self.projection = enorm, hnorm, projection
        self.block, self.norm, self.cross_entropy = block, norm, cross_entropy

    def layers(self) -> list[Any]:
        return [self.enorm, self.hnorm, self.projection, self.block, self.norm, self.cross_entropy]


def tokens_ahead(sequences: Array, k: int) -> tuple[Array, Array]:
    """Module k's inputs over (B, T) whole sequences' targets (column i holds t_{i+1}): the token ids t_{i+k} it
    embeds at each position i (0 past the end) and the targets t_{i+k+1} it predicts (`IGNORED` past the end)."""
    xp = get_array_module(sequences)
    length = sequences.shape[-1]
    past_end = xp.full((sequences.shape[0], k), IGNORED, sequences.dtype)
    extended = xp.concatenate((sequences, past_end), axis=1)  # column j: t_{j+1}
    embedded = extended[:, k - 1:k - 1 + length]
    return xp.where(embedded < 0, 0, embedded), extended[:, k:k + length]


class MultiTokenPrediction(Layer):
    """The head unit of a model with MTP: the main `LMHead`, then the `modules` (see the module docstring).
    `embedding` looks the next tokens up in the shared table; `weight` is λ; `context` the model's context axis
    (`models.axis.ContextAxis`: under context parallelism this rank's targets are only its zigzag chunks, and the
    tokens k ahead of them are on other ranks)."""

    def __init__(self, head: LMHead, modules: list[PredictionModule], embedding: Any, weight: float,
                 context: ContextAxis | None = None) -> None:
        if not modules or weight <= 0:
            raise ValueError(f"multi-token prediction needs at least one module and a weight > 0, got "
                             f"{len(modules)} and {weight}")
        self.head, self.modules, self.embedding, self.weight = head, modules, embedding, weight
        self.context = context or ContextAxis()

    def logits(self, x: Array) -> Array:
        """Next-token logits of the main head (the modules only train)."""
        return self.head.logits(x)

    def forward(self, x: Array, targets: Array, normalizer: float) -> tuple[float, Saved]:
        xp = get_array_module(x)
        loss, main = self.head.forward(x, targets, normalizer)
        sequences = self._whole_sequences(targets)
        length, share = sequences.shape[-1], len(self.modules) / self.weight
        kept, previous = [], x
        for k, module in enumerate(self.modules, start=1):
            if length - k < 1:
                raise ValueError(f"multi-token prediction module {k} predicts {k + 1} tokens ahead: the sequence "
                                 f"({length} tokens) is too short")
            tokens, predicted = (self._here(part) for part in tokens_ahead(sequences, k))
            embedded, embedding = self.embedding.forward(tokens)
            normed_embedding, enorm = module.enorm.forward(embedded)
            normed_hidden, hnorm = module.hnorm.forward(previous)
            z, projection = module.projection.forward(xp.concatenate((normed_embedding, normed_hidden), axis=-1))
            hidden, block = module.block.forward(z)
            normed, norm = module.norm.forward(hidden)
            module_loss, cross_entropy = module.cross_entropy.forward(normed, predicted,
                                                                      normalizer * (length - k) / length * share)
            loss += module_loss
            kept.append(Saved(embedding=embedding, enorm=enorm, hnorm=hnorm, projection=projection, block=block,
                              norm=norm, cross_entropy=cross_entropy))
            previous = hidden
        return loss, Saved(main=main, modules=kept)

    def _whole_sequences(self, targets: Array) -> Array:
        """The (B, T) targets of the whole sequences: this rank's own, or under CP every CP rank's zigzag chunks
        all-gathered and put back in order."""
        targets = targets.astype(get_array_module(targets).int64, copy=False)  # room for IGNORED
        return self.context.whole_sequences(targets)

    def _here(self, whole: Array) -> Array:
        """This rank's positions of a (B, T) array of the whole sequences (CP: its two zigzag chunks)."""
        return self.context.local_tokens(whole)

    def backward_input(self, saved: Saved, dout: None = None) -> Array:
        dx = self.head.backward_input(saved.main)
        dnext = None  # d(h^k) from module k + 1
        for module, kept in reversed(list(zip(self.modules, saved.modules, strict=True))):
            dhidden = module.norm.backward_input(kept.norm, module.cross_entropy.backward_input(kept.cross_entropy))
            if dnext is not None:
                dhidden += dnext
            dz = module.block.backward_input(kept.block, dhidden)
            dconcat = module.projection.backward_input(kept.projection, dz)
            channels = dconcat.shape[-1] // 2
            self.embedding.backward_input(kept.embedding, module.enorm.backward_input(kept.enorm,
                                                                                      dconcat[..., :channels]))
            dnext = module.hnorm.backward_input(kept.hnorm, dconcat[..., channels:])
        dx += dnext
        return dx

    def backward_weights(self, saved: Saved) -> None:
        self.head.backward_weights(saved.main)
        for module, kept in zip(self.modules, saved.modules, strict=True):
            module.cross_entropy.backward_weights(kept.cross_entropy)
            module.norm.backward_weights(kept.norm)
            module.block.backward_weights(kept.block)
            module.projection.backward_weights(kept.projection)
            module.hnorm.backward_weights(kept.hnorm)
            module.enorm.backward_weights(kept.enorm)
            self.embedding.backward_weights(kept.embedding)
        saved.clear()
