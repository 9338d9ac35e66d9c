"""Multi-token prediction (MTP, DeepSeek-V3 §2.2): D modules after the main model, module k predicting the token
k + 1 ahead, their losses added to the main loss with weight λ/D.

For a sequence t_0 … t_T (inputs t_0 … t_{T−1}, targets t_1 … t_T) and h⁰ the main model's last block output
(before the final norm), module k = 1 … D over the positions i = 0 … T − 1 − k:

    z_i^k   = eh_proj([enorm(Emb(t_{i+k})) | hnorm(h_i^{k−1})])     eh_proj [2h, h]; Emb the shared embedding
    h^k     = Block_k(z^k)                                          a causal block over T − k positions
    loss_k  = mean over the batch and i of CE(head(norm_k(h_i^k)), t_{i+k+1})     the shared output head,
                                                                                   its own final norm
    loss    = main loss + λ/D · Σ_k loss_k

(the order [embedding | hidden] is that of DeepSeek's checkpoint, and of transformers' `MtpLayer` and vLLM that
read it). The loss of each module is a mean over its own B·(T − k) predictions: the cross-entropy's normalizer is
the main one × (T − k)/T × D/λ, so microbatches and data-parallel ranks still add up to the global objective.

Backward runs the modules last to first: d(h^k) is its head's gradient plus module k + 1's through hnorm (on the
first T − k − 1 positions), and d(h⁰) adds module 1's to the main head's. The shared embedding and head weights
receive every module's gradient. Same protocol as `models.layers` (split backward included), held by the model
as its head unit, so it runs on the last pipeline stage. The modules' MoE blocks choose with no selection bias
and add no balance loss (their routing statistics do not feed the aux-loss-free balancing). Communication: that
of the layers it holds (tensor-parallel ones under TP).
"""

from __future__ import annotations

from typing import Any

from collectives.backend import Array, get_array_module

from .layers import Layer, LMHead, Saved


class PredictionModule:
    """One MTP module's layers: enorm, hnorm, eh_proj, the block, its final norm and the shared cross-entropy."""

    def __init__(self, enorm: Any, hnorm: Any, projection: Any, block: Any, norm: Any, cross_entropy: Any) -> None:
        self.enorm, self.hnorm, self.projection = enorm, hnorm, projection
        self.block, self.norm, self.cross_entropy = block, norm, cross_entropy

    def layers(self) -> list[Any]:
        return [self.enorm, self.hnorm, self.projection, self.block, self.norm, self.cross_entropy]


class MultiTokenPrediction(Layer):
    """The head unit of a model with MTP: the main `LMHead`, then the `modules` (see the module docstring).
    `embedding` looks the next tokens up in the shared table; `weight` is λ."""

    def __init__(self, head: LMHead, modules: list[PredictionModule], embedding: Any, weight: float) -> None:
        if not modules or weight <= 0:
            raise ValueError(f"multi-token prediction needs at least one module and a weight > 0, got "
                             f"{len(modules)} and {weight}")
        self.head, self.modules, self.embedding, self.weight = head, modules, embedding, weight

    def logits(self, x: Array) -> Array:
        """Next-token logits of the main head (the modules only train)."""
        return self.head.logits(x)

    def forward(self, x: Array, targets: Array, normalizer: float) -> tuple[float, Saved]:
        xp = get_array_module(x)
        loss, main = self.head.forward(x, targets, normalizer)
        length, share = targets.shape[-1], len(self.modules) / self.weight
        kept, previous = [], x
        for k, module in enumerate(self.modules, start=1):
            n = length - k
            if n < 1:
                raise ValueError(f"multi-token prediction module {k} predicts {k + 1} tokens ahead: the sequence "
                                 f"({length} tokens) is too short")
            embedded, embedding = self.embedding.forward(targets[:, k - 1:k - 1 + n])
            normed_embedding, enorm = module.enorm.forward(embedded)
            normed_hidden, hnorm = module.hnorm.forward(previous[:, :n])
            z, projection = module.projection.forward(xp.concatenate((normed_embedding, normed_hidden), axis=-1))
            hidden, block = module.block.forward(z)
            normed, norm = module.norm.forward(hidden)
            module_loss, cross_entropy = module.cross_entropy.forward(normed, targets[:, k:k + n],
                                                                      normalizer * n / length * share)
            loss += module_loss
            kept.append(Saved(embedding=embedding, enorm=enorm, hnorm=hnorm, projection=projection, block=block,
                              norm=norm, cross_entropy=cross_entropy))
            previous = hidden
        return loss, Saved(main=main, modules=kept)

    def backward_input(self, saved: Saved, dout: None = None) -> Array:
        dx = self.head.backward_input(saved.main)
        dnext = None  # d(h^k) from module k + 1, on its first T − k − 1 positions
        for module, kept in reversed(list(zip(self.modules, saved.modules, strict=True))):
            dhidden = module.norm.backward_input(kept.norm, module.cross_entropy.backward_input(kept.cross_entropy))
            if dnext is not None:
                dhidden[:, :dnext.shape[1]] += dnext
            dz = module.block.backward_input(kept.block, dhidden)
            dconcat = module.projection.backward_input(kept.projection, dz)
            channels = dconcat.shape[-1] // 2
            self.embedding.backward_input(kept.embedding, module.enorm.backward_input(kept.enorm,
                                                                                      dconcat[..., :channels]))
            dnext = module.hnorm.backward_input(kept.hnorm, dconcat[..., channels:])
        dx[:, :dnext.shape[1]] += dnext
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
