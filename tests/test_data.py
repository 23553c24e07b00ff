"""Criteo reader against a line-by-line Python reference; synthetic clicks' determinism and shape."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from embstore.training.data import MISSING_ID, ClickBatch, CriteoReader, SyntheticClicks, parse_lines, zipf_ranks

ND, NS = 3, 4  # a narrow Criteo-like format keeps the hand-made lines readable


def line(label="1", dense=("1", "2", "3"), cats=("a1", "ff", "0", "10")) -> str:
    return "\t".join([label, *dense, *cats]) + "\n"


def reference(lines, delim=None, missing="reserved"):
    """One sample at a time with int()/int(x, 16): (dense rows, labels, per-table bags, malformed)."""
    out, bad = [], 0
    for raw in lines:
        s = raw.rstrip("\r\n")
        if not s:
            continue
        f = s.split("\t")
        try:
            if len(f) != 1 + ND + NS or f[0] not in ("0", "1"):
                raise ValueError
            dense = [math.log1p(max(int(x) if x else 0, 0)) for x in f[1:1 + ND]]
            for x in f[1:1 + ND]:
                if x and not x.lstrip("-").isdigit():
                    raise ValueError
            bags = []
            for x in f[1 + ND:]:
                if not x:
                    bags.append([MISSING_ID] if missing == "reserved" else [])
                    continue
                toks = x.split(delim) if delim else [x]
                ids = []
                for tkn in toks:
                    if not tkn or len(tkn) > 16 or any(c not in "0123456789abcdefABCDEF" for c in tkn):
                        raise ValueError
                    ids.append(np.uint64(int(tkn, 16)).view(np.int64).item())
                bags.append(ids)
            out.append((dense, float(f[0]), bags))
        except ValueError:
            bad += 1
    return out, bad


def flatten(batches: list[ClickBatch]):
    rows = []
    for b in batches:
        for i in range(b.size):
            bags = [b.ids[t][int(b.offsets[t][i]):int(b.offsets[t][i + 1])].tolist() for t in range(NS)]
            rows.append((b.dense[i].tolist(), float(b.labels[i]), bags))
    return rows


HAND_MADE = [
    line(),
    line(label="0", dense=("", "-5", "7"), cats=("", "DEADBEEF", "", "1")),  # empty fields, negative dense
    "1\t2\t3\n",  # short line
    line(cats=("a1", "xyz", "0", "10")),  # non-hex token
    line(dense=("1", "2.5", "3")),  # non-integer dense
    line(label="2"),  # bad label
    "\n",  # blank: ignored
    line(cats=("a1", "ff", "0", "10")).replace("\t10\n", "\t10\textra\n"),  # too many fields
    line(label="0", cats=("1234567890abcdef", "7", "8", "9")),  # 16 hex digits: wraps to a negative id
    line(cats=("1234567890abcdef0", "7", "8", "9")),  # 17 digits: malformed
    line(dense=("--3", "1", "1")),
    line(label="1", dense=("100", "0", "0"), cats=("c", "d", "e", "f")),
]


def test_hand_made_file_skips_and_counts_malformed(tmp_path, caplog):
    p = tmp_path / "day.tsv"
    p.write_text("".join(HAND_MADE))
    reader = CriteoReader(p, batch_size=2, num_dense=ND, num_sparse=NS)
    with caplog.at_level("WARNING"):
        got = flatten(list(reader))
    ref, bad = reference(HAND_MADE)
    assert bad == 7 and reader.stats.malformed == 7 and reader.stats.blank == 1
    assert "skipped 7 malformed line(s)" in caplog.text
    assert len(got) == len(ref) == 4
    for (gd, gl, gb), (rd, rl, rb) in zip(got, ref):
        np.testing.assert_allclose(gd, rd, rtol=1e-6)
        assert gl == rl and gb == rb
    assert got[1][2][0] == [MISSING_ID] and got[1][2][1] == [0xDEADBEEF] and got[1][0][1] == 0.0


def test_missing_skip_gives_empty_bags_and_multi_hot(tmp_path):
    lines = [line(cats=("a,b,c", "", "ff", "1,2")), line(cats=("a,,b", "1", "2", "3")), line(cats=("", "", "", ""))]
    p = tmp_path / "mh.tsv"
    p.write_text("".join(lines))
    got = flatten(list(CriteoReader(p, 8, ND, NS, multi_hot_delimiter=",", missing="skip")))
    ref, bad = reference(lines, delim=",", missing="skip")
    assert bad == 1 and [g[2] for g in got] == [r[2] for r in ref]
    assert got[0][2] == [[10, 11, 12], [], [255], [1, 2]] and got[1][2] == [[], [], [], []]


token = st.one_of(st.just(""), st.text("0123456789abcdefABCDEF", min_size=1, max_size=17), st.sampled_from(["g", "-1", "1 "]))
dense_tok = st.one_of(st.just(""), st.integers(-10**6, 10**9).map(str), st.sampled_from(["x", "1.5", "-"]))


@settings(max_examples=40)
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from(["0", "1", "2"]), st.lists(dense_tok, min_size=ND, max_size=ND),
              st.lists(token, min_size=NS, max_size=NS)).map(lambda t: "\t".join([t[0], *t[1], *t[2]]) + "\n"),
    st.sampled_from(["\n", "1\t2\n", "0" + "\t" * (ND + NS) + "\n"])), max_size=25),
    st.integers(1, 7), st.integers(1, 5))
def test_reader_matches_reference(tmp_path_factory, lines, batch, chunk):
    p = tmp_path_factory.mktemp("h") / "f.tsv"
    p.write_text("".join(lines))
    reader = CriteoReader(p, batch, ND, NS, chunk_lines=chunk)
    batches = list(reader)
    got = flatten(batches)
    ref, bad = reference(lines)
    assert reader.stats.malformed == bad and len(got) == len(ref)
    assert all(b.size == batch for b in batches[:-1])
    for (gd, gl, gb), (rd, rl, rb) in zip(got, ref):
        np.testing.assert_allclose(gd, rd, rtol=1e-6)
        assert (gl, gb) == (rl, rb)


def test_resume_skip_holdout_split_and_gzip(tmp_path):
    rng = np.random.default_rng(0)
    lines = [line(label=str(i % 2), dense=(str(i), "0", "1"), cats=tuple(format(int(x), "x") for x in rng.integers(0, 999, NS)))
             for i in range(57)]
    p = tmp_path / "d.tsv.gz"
    with gzip.open(p, "wt") as f:
        f.write("".join(lines))
    full = list(CriteoReader(p, 5, ND, NS, chunk_lines=8))
    later = list(CriteoReader(p, 5, ND, NS, chunk_lines=8).iter_batches(4))
    assert flatten(later) == flatten(full[4:])
    train = flatten(list(CriteoReader(p, 5, ND, NS, split="train", holdout_every=4, chunk_lines=7)))
    held = flatten(list(CriteoReader(p, 5, ND, NS, split="holdout", holdout_every=4, chunk_lines=3)))
    held_rows = [round(math.expm1(r[0][0])) for r in held]
    assert held_rows == [i for i in range(57) if i % 4 == 3]
    assert sorted(round(math.expm1(r[0][0])) for r in train + held) == list(range(57))


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_a_damaged_gzip_file_is_a_typed_error(tmp_path, damage):
    """A gzip stream cut short (or a plain file named .gz) loses the rest of the file: no line to skip, so a
    typed error naming the file rather than gzip's EOFError (which the CLI would print as a traceback)."""
    import embstore

    text = "".join(line(label=str(i % 2)) for i in range(300)).encode()
    p = tmp_path / "d.tsv.gz"
    if damage == "truncated":
        whole = gzip.compress(text)
        p.write_bytes(whole[:len(whole) // 2])
    else:
        p.write_bytes(text)
    with pytest.raises(embstore.InvalidInputError, match="d.tsv.gz.*truncated or corrupt gzip"):
        list(CriteoReader(p, 16, ND, NS))


def test_parse_lines_vectorised_shapes():
    parsed, bad, blank = parse_lines([line(), line(label="0")], ND, NS)
    assert (parsed.n, bad, blank) == (2, 0, 0) and parsed.lengths.shape == (NS, 2)


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(FileNotFoundError):
        CriteoReader(tmp_path / "nope.tsv", 4)
    (tmp_path / "x.tsv").write_text(line())
    with pytest.raises(ValueError, match="holdout_every"):
        CriteoReader(tmp_path / "x.tsv", 4, split="train")
    with pytest.raises(ValueError, match="missing"):
        CriteoReader(tmp_path / "x.tsv", 4, missing="zero")


# --------------------------------------------------------------------------- synthetic
def test_synthetic_batches_are_pure_functions_of_index():
    s = SyntheticClicks((100, 1000, 10**9), batch_size=64, num_batches=5, bag_min=0, bag_max=3, seed=4)
    a, b = s.batch(3), list(s.iter_batches())[3]
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert all(torch.equal(x, y) for x, y in zip(a.ids, b.ids))
    assert list(s.iter_batches(2))[0].labels.equal(s.batch(2).labels)
    assert not torch.equal(s.batch(0, "holdout").labels, s.batch(0).labels)
    for t, n in enumerate(s.id_space):
        ids, offs = a.ids[t], a.offsets[t]
        assert ids.dtype == torch.int64 and len(offs) == 65 and offs[-1] == len(ids)
        assert int(ids.min()) >= 0 and int(ids.max()) < n
        assert (offs.diff() <= 3).all()


def test_synthetic_labels_follow_the_planted_weights():
    s = SyntheticClicks((50, 50), batch_size=20000, num_batches=1, signal=3.0, dense_signal=0.0, bias=0.0, seed=1)
    b = s.batch(0)
    w = s.hidden_weight(0, b.ids[0].numpy()) + s.hidden_weight(1, b.ids[1].numpy())
    y = b.labels.numpy()
    # samples with a high planted score click far more often than those with a low one
    assert y[w > 1].mean() > 0.75 and y[w < -1].mean() < 0.25
    shuffled = SyntheticClicks((50, 50), 20000, 1, signal=3.0, dense_signal=0.0, bias=0.0, seed=1, shuffle_labels=True)
    ys = shuffled.batch(0).labels.numpy()
    assert abs(ys[w > 1].mean() - ys[w < -1].mean()) < 0.05


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.0, 1.2])
def test_zipf_ranks_follow_the_power_law(alpha):
    n = 1000
    r = zipf_ranks(np.random.default_rng(0), n, alpha, 200_000)
    assert r.min() >= 0 and r.max() < n
    counts = np.bincount(r, minlength=n)
    # the frequency ratio of rank 0 to rank 9 matches (10/1)^alpha up to the continuous approximation
    ratio = counts[:1].sum() / counts[9:10].sum()
    assert ratio == pytest.approx(10 ** alpha, rel=0.35)
