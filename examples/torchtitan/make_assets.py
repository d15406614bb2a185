"""Write the local assets a torchtitan debug-model run reads, so nothing is downloaded.

torchtitan's wheel ships no ``tests/assets``; its llama3 ``debugmodel`` recipe reads a
Hugging Face tokenizer from ``--model.hf_assets_path`` and the ``c4_test`` dataset (JSON lines
with a ``text`` field, loaded with ``datasets.load_dataset(path, split="train")``) from
``--training.dataset_path``. This writes both under one folder:

    python examples/torchtitan/make_assets.py OUT_DIR

then run with ``--model.hf_assets_path OUT_DIR/tokenizer --training.dataset_path OUT_DIR/c4_test``.
The tokenizer is a character-level WordLevel model (printable ASCII plus ``<unk>``,
``<|begin_of_text|>``, ``<|end_of_text|>``: under 2,048 ids, the debug model's vocabulary);
the text is generated from a fixed seed, so every run reads the same tokens.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
WORDS = ("the model reads tokens and every rank sees its own shard of the batch while gradients are "
         "reduced across data parallel replicas tensor parallel shards split each matrix pipeline stages "
         "pass activations forward and gradients backward").split()


def write_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([UNK, BOS, EOS, *(chr(c) for c in range(32, 127))])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}))
    return out


def write_dataset(out: Path, *, docs: int = 2048, seed: int = 0) -> Path:
    # torchtitan splits the documents over the data-parallel ranks (split_dataset_by_node): a rank
    # left without one fails, so there are enough for 1,024 of them
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    # (datasets reads a file whose name holds "test" as the test split; torchtitan loads "train")
    with open(out / "train.json", "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))}) + "\n")
    return out


def write_assets(root: Path) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder) under ``root``."""
    root = Path(root)
    return write_tokenizer(root / "tokenizer"), write_dataset(root / "c4_test")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_assets.py OUT_DIR")
    for p in write_assets(Path(sys.argv[1])):
        print(p)
