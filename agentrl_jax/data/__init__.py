"""Data: validated task / SFT records from JSONL, JSON and Parquet (field names matched
ignoring case, repeated rows dropped and counted), and a checkpointable host-sharded batch
iterator built on grain.

    records, stats = load_task_records("dapo_math_17k.parquet", format="dapo_math")
    batches = BatchIterator(records, batch_size=32, seed=0,
                            shard_index=jax.process_index(), shard_count=jax.process_count())
    prompts = next(batches)              # list[TaskRecord]
    state = batches.get_state()          # JSON-able, goes into the checkpoint
"""

from agentrl_jax.data.dedup import Deduplicator, normalize_text, split_overlap
from agentrl_jax.data.formats import (
    SFT_FORMATS,
    TASK_FORMATS,
    load_sft_records,
    load_task_records,
    parse_aime_row,
    parse_dapo_math_row,
    parse_retool_sft_row,
    split_interpreter_blocks,
    strip_dapo_instruction,
)
from agentrl_jax.data.iterator import BatchIterator
from agentrl_jax.data.readers import DataError, DataStats, read_records, resolve_paths
from agentrl_jax.data.records import (
    ROLES,
    TASK_ANSWER_FIELDS,
    TASK_PROMPT_FIELDS,
    BadRowError,
    ChatMessage,
    SFTRecord,
    TaskRecord,
    parse_messages,
    parse_sft_row,
    parse_task_row,
)

__all__ = [
    "ROLES", "SFT_FORMATS", "TASK_ANSWER_FIELDS", "TASK_FORMATS", "TASK_PROMPT_FIELDS", "BadRowError", "BatchIterator", "ChatMessage", "DataError",
    "DataStats", "Deduplicator", "SFTRecord", "TaskRecord", "load_sft_records", "load_task_records",
    "normalize_text", "parse_aime_row", "parse_dapo_math_row", "parse_messages", "parse_retool_sft_row",
    "parse_sft_row", "read_records", "resolve_paths", "split_interpreter_blocks", "split_overlap",
    "strip_dapo_instruction",
]
