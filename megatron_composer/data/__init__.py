"""Data: the embedded stdlib corpus, the code tokenizer, indexed datasets, CPT/SFT datasets.

What the training loop calls::

    data = default_cpt_data(workdir)                   # or your own tokenizer + prefixes
    tokenizer = Tokenizer(data.tokenizer_model)
    train = CPTDataset(data.train_prefix, seq_length, seed)
    sample = train[epoch_index(consumed_samples, len(train), seed)]
    batch = collate_packed([...])

    sft_train, sft_valid = default_sft_data(workdir)
    sft = SFTDataset(sft_train, tokenizer, seq_length, seed)
"""

from megatron_composer.data.corpus import expand_inputs, iter_texts, stdlib_corpus
from megatron_composer.data.datasets import (
    CPTDataset,
    DefaultCPTData,
    SFTDataset,
    build_sft_jsonl,
    collate_packed,
    default_cpt_data,
    default_sft_data,
    epoch_index,
    packed_position_ids,
    render_chat,
)
from megatron_composer.data.indexed import (
    IndexedDatasetError,
    build_indexed_dataset,
    open_indexed_dataset,
    validate_indexed_dataset,
)
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "CPTDataset",
    "DefaultCPTData",
    "IndexedDatasetError",
    "SFTDataset",
    "Tokenizer",
    "build_indexed_dataset",
    "build_sft_jsonl",
    "collate_packed",
    "default_cpt_data",
    "default_sft_data",
    "epoch_index",
    "expand_inputs",
    "iter_texts",
    "open_indexed_dataset",
    "packed_position_ids",
    "render_chat",
    "stdlib_corpus",
    "train_tokenizer",
    "validate_indexed_dataset",
]
