"""mla-compare's prompts, tokenization, recipes and the conversion of vLLM's prompt logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_vllm.compare.engine import prompt_topk
from mla_vllm.compare.inputs import (
    Prompt,
    check_lengths,
    load_prompts,
    model_max_len,
    parse_recipes,
    tokenize,
)
from mla_vllm.config import MLAQuantConfigError


def _tokenizer_dir(root: Path) -> Path:
    """A model directory with a word-level tokenizer trained here (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the cat sat on the mat", "a dog ran to the cat", "the end"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    root.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(root))
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": 6}))
    return root


def test_prompt_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"the cat"\n[1, 2, 3]\n\n{"text": "a dog"}\n{"prompt_token_ids": [4, 5]}\n')
    got = load_prompts(jsonl)
    assert [(p.text, p.ids) for p in got] == [
        ("the cat", None),
        (None, (1, 2, 3)),
        ("a dog", None),
        (None, (4, 5)),
    ]
    assert got[2].where == "prompts: p.jsonl line 4"
    (tmp_path / "p.json").write_text('[[7, 8], "x y"]')
    assert [p.ids for p in load_prompts(tmp_path / "p.json")] == [(7, 8), None]
    (tmp_path / "p.txt").write_text("first line\n\nsecond line\n")
    assert [p.text for p in load_prompts(tmp_path / "p.txt")] == ["first line", "second line"]
    (tmp_path / "bad.jsonl").write_text('[1, "x"]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: expected a non-empty list"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "obj.jsonl").write_text('{"question": "?"}\n')
    with pytest.raises(ValueError, match="'text'/'prompt' string or 'token_ids'"):
        load_prompts(tmp_path / "obj.jsonl")
    with pytest.raises(ValueError, match="prompts: cannot read"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(tmp_path / "empty.txt")


def test_tokenize_with_the_models_tokenizer_and_lengths(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = _tokenizer_dir(tmp_path / "model")
    prompts = [Prompt("a", text="the cat sat"), Prompt("b", ids=(3, 1))]
    got = tokenize(prompts, str(model))
    want = AutoTokenizer.from_pretrained(str(model))("the cat sat")["input_ids"]
    assert got[0].ids == tuple(want) and len(want) == 3 and got[1].ids == (3, 1)
    limit = model_max_len(str(model), None)
    assert limit == 6
    check_lengths(got, limit)
    long = tokenize(
        [Prompt("prompts: p.txt line 2", text="the cat sat on the mat the end")], str(model)
    )
    with pytest.raises(ValueError, match=r"line 2: 8 tokens, longer than max_model_len 6"):
        check_lengths(long, limit)
    with pytest.raises(ValueError, match="1 token"):
        check_lengths([Prompt("c", ids=(1,))], None)


def test_text_prompts_for_a_tokenizer_less_model(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"line 1: text, but .* has no tokenizer .* token ids"):
        tokenize([Prompt("prompts: p.txt line 1", text="hello")], str(bare))
    ids = [Prompt("x", ids=(1, 2))]
    assert tokenize(ids, str(bare)) == ids  # token ids need no tokenizer


def test_recipes(tmp_path: Path) -> None:
    file = tmp_path / "shadow.json"
    file.write_text(json.dumps({"mla_quant": {"recipe": "nvfp4", "kv_path": "shadow"}}))
    recipes = parse_recipes(
        ["none", "fp8", f"mine={file}", '{"recipe": "nvfp4", "kv_path": "shadow"}', "fp8"]
    )
    assert [r.name for r in recipes] == ["none", "fp8", "mine", "nvfp4-shadow", "fp8-2"]
    assert recipes[2].config == {"recipe": "nvfp4", "kv_path": "shadow"}
    assert recipes[0].config == {"recipe": "none"}
    with pytest.raises(ValueError, match=r"no such recipe file 'nvpf4.json', and not a format"):
        parse_recipes(["nvpf4.json"])
    with pytest.raises(MLAQuantConfigError, match=r"--recipe .*: mla_quant\.k: unknown format"):
        parse_recipes(['{"k": "int4"}'])
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_recipes(['{"recipe": nvfp4}'])
    with pytest.raises(ValueError, match="at least one recipe"):
        parse_recipes([])


def test_prompt_topk_from_vllm_logprobs() -> None:
    from vllm.logprobs import Logprob

    ids = [5, 7, 9]
    plp = [
        None,
        {3: Logprob(-0.5, 1), 7: Logprob(-1.5, 2)},  # the prompt's token is in the top-2
        {2: Logprob(-0.1, 1), 4: Logprob(-2.6, 2), 9: Logprob(-4.0, 5)},  # outside: rank 5
    ]
    got = prompt_topk(plp, ids, 2)
    assert got == {
        "ids": [[3, 7], [2, 4]],
        "logprobs": [[-0.5, -1.5], [-0.1, -2.6]],
        "target": [-1.5, -4.0],
    }
    with pytest.raises(ValueError, match="2 positions for a 3-token prompt"):
        prompt_topk(plp[:2], ids, 2)
    with pytest.raises(ValueError, match=r"prompt_logprobs\[1\]: 2 ranked entries, expected 3"):
        prompt_topk(plp, ids, 3)
