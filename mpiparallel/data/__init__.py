"""Training data: token files and llm.c shards, tokenizers, `data prepare`, and the batch order every rank
and every resume relies on.

- `order`: which tokens step s trains on — a pure function of (step, seed, epoch), llm.c's order extended shard
  by shard; each rank reads only its rows.
- `shards`: llm.c's shard format (header of 256 int32, uint16 or uint32 tokens), memory-mapped.
- `dataset`: what `--data` / `--val-data` name (folder, shard, glob, `.npy`, text), opened as token segments,
  with the fingerprint training checkpoints record.
- `sources`: token files loaded whole (`.npy`, bytes) and the default corpus.
- `tokenizer`: Hugging Face `tokenizers` (or raw bytes) behind one small interface.
- `prepare`: the work of `mpiparallel data prepare` and `data info`, and the default corpus's cached BPE
  folder.
"""

from .dataset import Dataset, open_data, validation_in_folder
from .order import (
    BatchOrder,
    Microbatch,
    TokenBatches,
    batch_for_step,
    full_batch_count,
    in_memory,
    microbatches,
    row_range,
    rows_for_rank,
)
from .prepare import cached_default_corpus
from .sources import (
    BYTE_VOCAB_SIZE,
    TokenData,
    check_vocab,
    default_corpus,
    load_tokens,
    split_train_validation,
)
from .tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, load_tokenizer, tokenizer_of_folder

__all__ = ["BYTE_VOCAB_SIZE", "BatchOrder", "ByteTokenizer", "Dataset", "HuggingFaceTokenizer", "Microbatch",
           "TokenBatches",
           "TokenData", "Tokenizer", "batch_for_step", "cached_default_corpus", "check_vocab", "default_corpus",
           "full_batch_count", "in_memory", "load_tokenizer", "load_tokens", "microbatches", "open_data", "row_range",
           "rows_for_rank", "split_train_validation", "tokenizer_of_folder", "validation_in_folder"]
