"""What training reads: the tokens (`--data`, or the default corpus), the validation batches, the model's shape
(`--init`'s config.json or the flags) and the tokenizer that decodes it — each checked against the others, so
that a model never trains on ids its vocabulary or its tokenizer does not mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.documents import ATTENTION_KINDS
from models.transformer import GPTConfig

from .. import data
from ..checkpoints import hugging_face
from ..errors import ConfigError, on_every_rank
from .settings import CONFIG_FIELDS, ModelSettings, TrainSettings


def open_data(settings: TrainSettings, world: Any) -> tuple[data.Dataset, data.Dataset | None]:
    """--data (memory-mapped shards or tokens in memory) and its validation: --val-data, else the validation
    shards of a data folder, else (None) the last --validation-fraction of the training tokens. Without --data:
    the default corpus's cached BPE folder."""
    path = settings.data.data if settings.data.data is not None else str(_default_corpus_folder(world))
    dataset = data.open_data(path)
    if settings.data.val_data is not None:
        return dataset, data.open_data(settings.data.val_data, role="val")
    return dataset, data.validation_in_folder(path)


def _default_corpus_folder(world: Any) -> Path:
    """Rank 0 prepares the default corpus on first use (a few seconds, said on its output) while the others wait;
    then every rank finds it, or, where its node does not share rank 0's cache folder, builds the same files."""
    on_every_rank(world, lambda: data.cached_default_corpus(announce=print) if world.rank == 0 else None)
    return on_every_rank(world, data.cached_default_corpus)


def settle_vocab(settings: TrainSettings, dataset: data.Dataset) -> TrainSettings:
    """--vocab-size, by default the data's (data.json's tokenizer) or 256 (bytes)."""
    if settings.model.vocab_size is not None:
        return settings
    return settings.with_options(vocab_size=dataset.vocab_size or data.BYTE_VOCAB_SIZE)


def settle_documents(settings: TrainSettings, dataset: data.Dataset) -> TrainSettings:
    """--attention document's end-of-text id: --eot-id, else the data folder's data.json's; one clear error when
    neither gives one, or when it lies outside the vocabulary (after `settle_vocab`)."""
    if settings.model.attention not in ATTENTION_KINDS:
        raise ConfigError(f"--attention must be one of {', '.join(ATTENTION_KINDS)}, got {settings.model.attention!r}")
    eot_id = settings.data.eot_id
    if settings.model.attention == "causal":
        if eot_id is not None:
            raise ConfigError("--eot-id needs --attention document (the token that opens each document)")
        return settings
    if eot_id is None:
        eot_id = dataset.info.get("eot_id")
        if eot_id is None:
            raise ConfigError(f"--attention document needs the end-of-text id that opens each document: "
                              f"{dataset.description} has no data.json that names one; give --eot-id N")
    vocab = settings.model.vocab_size
    if vocab is not None and not 0 <= eot_id < vocab:
        raise ConfigError(f"--eot-id {eot_id} is not a token of the model's vocabulary of {vocab}")
    return settings.with_options(eot_id=int(eot_id))


def model_config(settings: TrainSettings) -> GPTConfig:
    """The model's shape: from --init's config.json, or from the flags."""
    if settings.model.init:
        config = hugging_face.load_pretrained(settings.model.init)[0]
    else:
        shape = settings.model
        try:
            config = GPTConfig(vocab_size=shape.vocab_size, n_positions=max(shape.n_positions, settings.data.seq_len),
                               moe_aux_coef=switch_aux_coef(shape), **_family_choices(shape), **config_fields(
                                   shape, "n_embd", "n_layer", "n_head", "experts", "top_k", "moe_renormalize",
                                   "capacity_factor", "moe_bias_rate"))
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if settings.data.seq_len > config.n_positions:
        raise ConfigError(f"--seq-len {settings.data.seq_len} exceeds the model's n_positions ({config.n_positions})")
    if settings.model.moe_aux_scope == "global" and not config.moe_aux_coef:
        raise ConfigError("--moe-aux-scope global forms the Switch aux loss over the whole step: it needs "
                          "--moe-aux-coef > 0 (deepseek_v3 balances with --moe-bias-rate and --moe-seq-aux-coef "
                          "instead)")
    if settings.model.attention == "document" and config.mtp_depth:
        raise ConfigError("--attention document with --mtp-depth is not built yet: a prediction module's targets "
                          "would reach into the next document; use --mtp-depth 0")
    return config


def _family_choices(shape: ModelSettings) -> dict[str, Any]:
    """The GPTConfig fields of --arch and its llama options; a llama option given for GPT-2 is one clear error."""
    choices = {"n_kv_head": shape.n_kv_head, "ffn_hidden": shape.ffn_hidden, "tie_embeddings": shape.tie_embeddings}
    given = [f"--{name.replace('_', '-')}" for name, value in choices.items() if value is not None]
    if shape.rope_theta != ModelSettings.rope_theta:
        given.append("--rope-theta")
    if shape.arch == "gpt2" and given:
        raise ConfigError(f"{', '.join(given)} set(s) a llama choice: add --arch llama (GPT-2 has multi-head "
                          f"attention, a 4·n_embd MLP, learned positions and a tied head)")
    return {"arch": shape.arch, "n_kv_head": shape.n_kv_head or 0, "ffn_hidden": shape.ffn_hidden or 0,
            "rope_theta": shape.rope_theta, "tie_embeddings": shape.tie_embeddings} | deepseek_choices(shape)


DEEPSEEK_DEFAULTS = {name: getattr(ModelSettings, name) for name in (
    "shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense", "moe_seq_aux_coef",
    "mtp_depth", "mtp_weight")}
"""deepseek_v3's options that have a value by default, with it (written once, in ModelSettings)."""
DEEPSEEK_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "moe_ffn_hidden")


def deepseek_choices(shape: ModelSettings) -> dict[str, Any]:
    """The GPTConfig fields of --arch deepseek_v3; one clear error when one is given for another family. Defaults
    (DeepSeek-V2-Lite's proportions): nope and value heads n_embd/n_head, RoPE heads half that (even),
    kv_lora_rank n_embd/4, no query compression, experts ffn_hidden/8 wide, one shared expert."""
    given = [name for name in DEEPSEEK_SIZES if getattr(shape, name) is not None]
    given += [name for name, default in DEEPSEEK_DEFAULTS.items() if getattr(shape, name) != default]
    if shape.arch != "deepseek_v3":
        if given:
            raise ConfigError(f"{', '.join('--' + name.replace('_', '-') for name in given)} set(s) a deepseek_v3 "
                              f"choice: add --arch deepseek_v3")
        return {}
    head = max(shape.n_embd // shape.n_head, 1)
    nope = shape.qk_nope_head_dim or head
    width = shape.ffn_hidden or 64 * -(-(8 * shape.n_embd) // (3 * 64))
    return {"q_lora_rank": shape.q_lora_rank, "kv_lora_rank": shape.kv_lora_rank or max(shape.n_embd // 4, 1),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": shape.qk_rope_head_dim or max(2, nope // 2 // 2 * 2),
            "v_head_dim": shape.v_head_dim or head, "moe_ffn_hidden": shape.moe_ffn_hidden or max(width // 8, 1),
            } | config_fields(shape, *DEEPSEEK_DEFAULTS)


def config_fields(shape: ModelSettings, *names: str) -> dict[str, Any]:
    """The GPTConfig fields the options `names` set, by the model's names (`settings.CONFIG_FIELDS`)."""
    return {CONFIG_FIELDS.get(name, name): getattr(shape, name) for name in names}


def switch_aux_coef(shape: ModelSettings) -> float:
    """--moe-aux-coef, by default GPTConfig's (deepseek_v3: 0; it balances with the bias and the sequence-wise
    loss)."""
    if shape.moe_aux_coef is not None:
        return shape.moe_aux_coef
    return 0.0 if shape.arch == "deepseek_v3" else GPTConfig.moe_aux_coef


def tokenizer(settings: TrainSettings, dataset: data.Dataset, config: GPTConfig) -> data.Tokenizer | None:
    """What decodes this model's tokens: the data folder's tokenizer, else the --init folder's, else bytes when
    the vocabulary is bytes (256, or 257 with the end-of-text token of `data prepare --tokenizer byte`).

    A model folder (--init) whose tokenizer differs from the data's is an error: the weights learned other
    tokens for those ids, and --save would write the data's tokenizer beside them."""
    of_data = data.tokenizer_of_folder(dataset.folder, dataset.info)
    of_model = data.tokenizer_of_folder(settings.model.init)
    if of_data is not None and of_model is not None and of_data.digest() != of_model.digest():
        where = settings.data.data or "the default corpus (no --data)"
        raise ConfigError(
            f"--init {settings.model.init} has its own tokenizer ({of_model.vocab_size} tokens, digest "
            f"{of_model.digest()}), but {where} is tokenized by another ({of_data.vocab_size} tokens, digest "
            f"{of_data.digest()}): the model would read ids that meant other text. Tokenize the text with the "
            f"model's: mpiparallel data prepare TEXT --tokenizer {settings.model.init} --out DIR, then --data DIR")
    found = of_data or of_model
    if found is None and config.vocab_size <= data.ByteTokenizer.vocab_size:
        return data.ByteTokenizer()
    return found


def batches(settings: TrainSettings, config: GPTConfig, dataset: data.Dataset, validation: data.Dataset | None
            ) -> tuple[data.TokenBatches, data.TokenBatches | None]:
    """The training batches in the contract's order and, with --eval-every, the validation batches; every token
    source checked against the model's vocabulary (in memory now; memory-mapped shards as they are read)."""
    vocab, shape = config.vocab_size, (settings.data.batch_size, settings.data.seq_len)
    for source in (dataset, validation):
        if source is not None:
            _check_vocab(source, vocab)
    if validation is None and settings.data.eval_every:
        dataset, validation = dataset.split_tail(settings.data.validation_fraction)
        if validation.token_count < shape[0] * shape[1] + 1:
            raise ConfigError(f"the held-out {settings.data.validation_fraction:.0%} of the data has "
                              f"{validation.token_count} tokens; one validation batch needs {shape[0] * shape[1] + 1}."
                              f" Use more data or a larger --validation-fraction, --val-data, or leave out "
                              f"--eval-every")
    train_batches = dataset.batches(*shape, settings.data.shuffle, settings.model.seed, vocab)
    if validation is None or not settings.data.eval_every:
        return train_batches, None
    return train_batches, validation.batches(*shape, vocab_size=vocab)


def _check_vocab(dataset: data.Dataset, vocab_size: int) -> None:
    """What is known before reading: the ids of tokens in memory, the vocabulary data.json names."""
    needed = dataset.vocab_needed or dataset.vocab_size or 0
    if needed > vocab_size:
        what = "contains token id" if dataset.vocab_needed else "was prepared with a tokenizer of vocabulary"
        shown = needed - 1 if dataset.vocab_needed else needed
        raise ConfigError(f"{dataset.description} {what} {shown}, but the model's vocabulary has {vocab_size} "
                          f"tokens; use --vocab-size {needed} or more")


def data_identity(settings: TrainSettings, dataset: data.Dataset) -> dict[str, Any]:
    """What a resumed run must find again: the training data's fingerprint and its order."""
    return {"fingerprint": dataset.fingerprint(), "shuffle": settings.data.shuffle}
