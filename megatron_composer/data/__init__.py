"""Data: the embedded stdlib corpus, the code tokenizer, indexed datasets, CPT/SFT datasets.

One concern per module: ``corpus`` (stdlib files), ``tokenizer``,
``indexed`` (megatron-core ``.bin``/``.idx``), ``packing`` (sample format,
epochs, collation), ``cpt``, ``sft``, ``synthetic_sft`` (SFT set from
source), ``default`` (the embedded default data), ``random_tokens``.

What the training loop calls::

    data = default_cpt_data(workdir)                   # or your own tokenizer + prefixes
    tokenizer = Tokenizer(data.tokenizer_model)
    train = CPTDataset(data.train_prefix, seq_length, seed, vocab_size=tokenizer.vocab_size)
    sample = train[epoch_index(consumed_samples, len(train), seed)]
    batch = collate_packed([...])

    sft_train, sft_valid = default_sft_data(workdir)
    sft = SFTDataset(sft_train, tokenizer, seq_length, seed)
"""

from megatron_composer.data.corpus import expand_inputs, iter_texts, stdlib_corpus
from megatron_composer.data.cpt import CPTDataset, check_token_range
from megatron_composer.data.default import DefaultCPTData, default_cpt_data, default_sft_data
from megatron_composer.data.indexed import (
    IndexedDatasetError,
    build_indexed_dataset,
    open_indexed_dataset,
    validate_indexed_dataset,
)
from megatron_composer.data.packing import (
    collate_packed,
    epoch_index,
    packed_position_ids,
    row_boundaries,
    sample_dict,
)
from megatron_composer.data.random_tokens import RandomTokenDataset
from megatron_composer.data.sft import CHAT_ROLES, SFTDataset, read_conversations, render_chat
from megatron_composer.data.synthetic_sft import build_sft_jsonl, sft_examples_from_source
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "CHAT_ROLES",
    "CPTDataset",
    "DefaultCPTData",
    "IndexedDatasetError",
    "RandomTokenDataset",
    "SFTDataset",
    "Tokenizer",
    "build_indexed_dataset",
    "build_sft_jsonl",
    "check_token_range",
    "collate_packed",
    "default_cpt_data",
    "default_sft_data",
    "epoch_index",
    "expand_inputs",
    "iter_texts",
    "open_indexed_dataset",
    "packed_position_ids",
    "read_conversations",
    "render_chat",
    "row_boundaries",
    "sample_dict",
    "sft_examples_from_source",
    "stdlib_corpus",
    "train_tokenizer",
    "validate_indexed_dataset",
]
