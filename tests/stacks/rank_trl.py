"""TRL's RewardTrainer on accelerate's FSDP2 path: train, save_model, reload, same rewards.

    torchrun --nproc-per-node 2 tests/stacks/rank_trl.py OUTPUT_DIR

A tiny preference dataset in memory and a word-level tokenizer built here (nothing from the hub).
transformers' Trainer builds its ``Accelerator`` from the FSDP settings of ``RewardConfig``;
accelerate then stays on DDP on a CPU, so the Trainer is given an ``Accelerator`` subclass that
selects FSDP the way accelerate does on GPUs (see ``rank_common.select_fsdp``). The traps users
meet with or without the patch are avoided the documented way: ``bf16=False`` (RewardConfig's
default bf16 fails on a CPU) and ``FSDP_STATE_DICT_TYPE=FULL_STATE_DICT`` (the default sharded
state dict makes ``save_model`` write no weights).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rank_common import (
    emit,
    init_mesh,
    is_sharded,
    max_difference,
    run,
    select_fsdp,
    tiny_config,
    wrapper_facts,
)

WORDS = ["[PAD]", "[UNK]", "good", "great", "fine", "bad", "awful", "poor", "answer", "the", "is"]
PAIRS = [
    ("the answer is good", "the answer is bad"),
    ("the answer is great", "the answer is awful"),
    ("the answer is fine", "the answer is poor"),
    ("good answer", "bad answer"),
    ("great answer", "awful answer"),
    ("fine answer", "poor answer"),
    ("the good answer", "the bad answer"),
    ("the great answer", "the poor answer"),
]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def patch_trainer_accelerator() -> None:
    """Make transformers' Trainer build an Accelerator that is on the FSDP2 path on a CPU."""
    import transformers.trainer
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    class FSDP2Accelerator(Accelerator):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The plugin the Trainer asked for through RewardConfig(fsdp=..., fsdp_config=...),
            # read from the environment as accelerate reads it.
            select_fsdp(kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin())
            assert self.is_fsdp2

    transformers.trainer.Accelerator = FSDP2Accelerator


def rewards(model: Any, tokens: Any) -> list[float]:
    import torch

    with torch.no_grad():
        return model(**tokens).logits.squeeze(-1).tolist()


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    (output,) = argv
    init_mesh()
    # What `accelerate launch --fsdp_version 2 --fsdp_state_dict_type FULL_STATE_DICT` exports:
    # transformers 4.55 passes no FSDP version from fsdp_config to accelerate.
    os.environ["FSDP_VERSION"] = "2"
    os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"
    patch_trainer_accelerator()
    tok = tokenizer()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(vocab_size=len(WORDS), pad_token_id=tok.pad_token_id))
    dataset = Dataset.from_dict({"chosen": [c for c, _ in PAIRS], "rejected": [r for _, r in PAIRS]})
    config = RewardConfig(
        output_dir=output, bf16=False, use_cpu=True, per_device_train_batch_size=2, max_steps=4,
        learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        max_length=16, disable_tqdm=True, dataloader_num_workers=0,
        fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                     # sync_module_states (on by default) asks for a GPU; every rank builds the
                     # same weights here anyway.
                     "sync_module_states": False, "cpu_ram_efficient_loading": False},
    )
    trainer = RewardTrainer(model=model, args=config, processing_class=tok, train_dataset=dataset)
    probe = tok([c for c, _ in PAIRS] + [r for _, r in PAIRS], return_tensors="pt", padding=True)
    initial = rewards(trainer.model, probe)
    trainer.train()
    trained = trainer.model_wrapped
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trained_rewards = rewards(trained, probe)
    sharded = is_sharded(trained)
    trainer.save_model(output)
    dist.barrier()
    reloaded = AutoModelForSequenceClassification.from_pretrained(output)
    reloaded_rewards = rewards(reloaded, probe)
    half = len(PAIRS)
    emit(
        case="trl",
        distributed_type=str(trainer.accelerator.distributed_type),
        wrapper=wrapper_facts(trained),
        layer_wrapper=type(trained.base_model.layers[0]).__name__,
        sharded=sharded,
        saved_files=sorted(os.listdir(output)),
        losses=losses,
        moved=max_difference(trained_rewards, initial),
        margin_before=sum(initial[:half]) / half - sum(initial[half:]) / half,
        margin_after=sum(trained_rewards[:half]) / half - sum(trained_rewards[half:]) / half,
        reloaded_vs_trained=max_difference(reloaded_rewards, trained_rewards),
    )


if __name__ == "__main__":
    sys.exit(run(main))
