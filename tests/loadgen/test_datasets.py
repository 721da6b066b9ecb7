import os
import random

import pytest

from orchard.cluster.bench.loadgen.datasets import DatasetConfig, UnknownDataset, conversations
from orchard.cluster.bench.loadgen.prompts import LengthRange, TokenizerPrompts, WordPrompts, WordTablePrompts


@pytest.fixture(scope="module")
def tokens(demo_model_path):
    return TokenizerPrompts(str(demo_model_path))


@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_tokenizer_prompts_have_exactly_the_requested_token_count(tokens, n):
    rng = random.Random(n)
    for _ in range(5):
        assert tokens.count(tokens.text(n, rng)) == n


def test_tokenizer_path_may_name_the_file_or_its_folder(demo_model_path):
    by_file = TokenizerPrompts(str(demo_model_path / "tokenizer.json"))
    by_dir = TokenizerPrompts(str(demo_model_path))
    assert by_file.text(20, random.Random(1)) == by_dir.text(20, random.Random(1))
    assert by_dir.exact and not WordPrompts().exact


def test_word_prompts_use_one_word_per_requested_token():
    assert WordPrompts().count(WordPrompts().text(37, random.Random(0))) == 37


def test_length_range_draws_within_its_bounds():
    lr = LengthRange(100, 0.25)
    rng = random.Random(0)
    draws = [lr.draw(rng) for _ in range(2000)]
    assert (lr.low, lr.high) == (75, 125)
    assert min(draws) == 75 and max(draws) == 125
    assert LengthRange(10).draw(rng) == 10


@pytest.mark.parametrize("mean, ratio", [(0, 0.0), (10, 1.0), (10, -0.1)])
def test_length_range_rejects_impossible_lengths(mean, ratio):
    with pytest.raises(ValueError):
        LengthRange(mean, ratio)


def test_random_dataset_yields_single_turn_requests_of_the_asked_lengths(tokens):
    cfg = DatasetConfig("random", LengthRange(40, 0.5), LengthRange(16, 0.5), seed=4)
    convs = list(conversations(cfg, tokens, 25))
    assert len(convs) == 25 and all(len(c.turns) == 1 and not c.chat for c in convs)
    turns = [c.turns[0] for c in convs]
    assert all(20 <= t.input_tokens <= 60 and tokens.count(t.text) == t.input_tokens for t in turns)
    assert all(8 <= t.max_tokens <= 24 for t in turns)
    assert len({t.input_tokens for t in turns}) > 5


def test_same_seed_gives_the_same_workload(tokens):
    cfg = DatasetConfig("random", seed=9)
    assert list(conversations(cfg, tokens, 5)) == list(conversations(cfg, tokens, 5))


def test_prefix_repetition_shares_exactly_num_prefixes_prefixes(tokens):
    cfg = DatasetConfig("prefix-repetition", LengthRange(8), LengthRange(4), num_prefixes=3, prefix_len=32, seed=1)
    texts = [c.turns[0].text for c in conversations(cfg, tokens, 40)]
    groups: dict[str, list[str]] = {}
    for t in texts:
        groups.setdefault(t[:20], []).append(t)
    assert len(groups) == 3
    assert len(set(texts)) == 40  # every suffix is unique
    for members in groups.values():
        shared = os.path.commonprefix(members)
        assert tokens.count(shared) >= 31  # the whole 32-token prefix, give or take the seam
    for t in texts:
        assert 32 + 8 <= tokens.count(t) <= 32 + 8 + 2  # merges at the seam may add a token


def test_multi_turn_conversations_hold_turns_and_use_chat(tokens):
    cfg = DatasetConfig("multi-turn", LengthRange(10), LengthRange(5), turns=3)
    convs = list(conversations(cfg, tokens, 8))
    assert [len(c.turns) for c in convs] == [3, 3, 2]  # 8 requests in all, the last cut short
    assert all(c.chat for c in convs)
    assert [c.id for c in convs] == [0, 1, 2]


def test_chat_api_applies_to_single_turn_datasets():
    cfg = DatasetConfig("random", api="chat")
    assert next(conversations(cfg, WordPrompts(), 1)).chat


def test_unknown_dataset_is_refused():
    with pytest.raises(UnknownDataset):
        DatasetConfig("sharegpt")


def test_word_table_prompts_compose_exact_counts_and_keep_them_after_a_space():
    first = {"a": 1, "bb": 2, "ccc": 1, "dddd": 3}
    after = {"a": 1, "bb": 2, "ccc": 2, "dddd": 3}  # "ccc" counts otherwise after a space: never an opener
    table = WordTablePrompts(first, after, "scripted")
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 47):
        for _ in range(20):
            text = table.text(n, rng)
            assert table.count(text) == n and table.count("a " + text) == n + 1
            assert not text.startswith("ccc")


def test_word_table_needs_a_single_token_word():
    with pytest.raises(ValueError):
        WordTablePrompts({"bb": 2}, {"bb": 2}, "scripted")
