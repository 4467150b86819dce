"""workers/model/gguf_file.py against gguf.GGUFReader, GGUF round trips and broken files, and the GGUF
tokenizer built from the shared parse against transformers' own conversion."""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from transformers import AutoTokenizer

from tierserve.runtime import tokenizer as tokenizer_mod
from tierserve.runtime.tokenizer import Tokenizer, load_tokenizer
from tierserve.workers.model import gguf_file as gguf_file_mod
from tierserve.workers.model import loader
from tierserve.workers.model.gguf_file import GGUFFile, open_gguf

DEFAULT = loader.default_model_path()


def reader_fields(reader: gguf.GGUFReader) -> dict:
    # GGUFReader adds the header counts as pseudo fields named GGUF.*.
    return {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def as_python(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def assert_matches_reader(ours: GGUFFile, reader: gguf.GGUFReader, skip=()) -> None:
    fields = reader_fields(reader)
    assert list(ours.fields) == list(fields)
    assert ours.version == reader.fields["GGUF.version"].contents()
    for key, field in fields.items():
        if key in skip:
            continue
        expected, got = field.contents(), as_python(ours.fields[key])
        assert got == expected and type(got) is type(expected), key
        if isinstance(ours.fields[key], np.ndarray):  # the declared element type is kept
            assert ours.fields[key].dtype == field.parts[field.data[0]].dtype.newbyteorder("<"), key
    assert ours.alignment == reader.alignment and ours.data_offset == reader.data_offset
    assert len(ours.tensors) == len(reader.tensors)
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.name == theirs.name
        assert mine.tensor_type == theirs.tensor_type and isinstance(mine.tensor_type, QT)
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert mine.offset == theirs.data_offset
        assert mine.data.dtype == np.uint8 and not mine.data.flags.writeable
        assert mine.data.nbytes == theirs.n_bytes
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name


# ---------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def default_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(DEFAULT)


def test_default_gguf_matches_gguf_reader(default_reader):
    ours = GGUFFile(DEFAULT)
    assert_matches_reader(ours, default_reader)
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert ours.get("tokenizer.ggml.token_type").dtype == np.int32
    assert ours.get("no.such.key", 7) == 7


def test_default_gguf_dequantizes_like_gguf_reader(default_reader):
    ours = {t.name: t for t in GGUFFile(DEFAULT).tensors}
    for theirs in default_reader.tensors[:12]:  # Q4_1 matrices and F32 norms
        mine = ours[theirs.name]
        got = gguf.quants.dequantize(mine.data, mine.tensor_type)
        expected = gguf.quants.dequantize(theirs.data, theirs.tensor_type)
        assert got.shape == mine.shape == expected.shape
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_loader_dequantizes_every_default_tensor_bit_for_bit_like_gguf():
    """The loader's whole-tensor Q4_1 / Q8_0 dequantizers round as gguf.quants does, on every
    tensor of the default file (the quantized-linear route re-derives codes from these)."""
    types = set()
    for t in GGUFFile(DEFAULT).tensors:
        got = loader.dequantize_gguf(t.data, t.tensor_type)
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        assert got.dtype == np.float32 and got.shape == expected.shape == t.shape, t.name
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), t.name
        types.add(t.tensor_type)
    assert {QT.Q4_1, QT.Q8_0, QT.F32} <= types


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0], ids=["q4_1", "q8_0"])
def test_loader_dequantizers_match_gguf_on_random_and_special_blocks(qtype):
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(3, 5, 4 * block_bytes), dtype=np.uint8)
    scales = np.array([0.0, -0.0, 1e-7, 65504.0, -3.5, np.inf, -np.inf, np.nan],
                      dtype=np.float16).view(np.uint8).reshape(-1, 2)
    blocks = data.reshape(-1, block_bytes)
    blocks[:len(scales), :2] = scales  # d: zero, subnormal, largest, infinities, NaN
    if qtype == QT.Q4_1:
        blocks[len(scales):2 * len(scales), 2:4] = scales  # and m
    got = loader.dequantize_gguf(data, qtype)
    with np.errstate(invalid="ignore"):  # inf * 0
        expected = gguf.quants.dequantize(data, qtype)
    assert got.shape == expected.shape == (3, 5, 128)
    nan = np.isnan(expected)
    assert nan.any() and np.array_equal(np.isnan(got), nan)  # a NaN's sign bit is the CPU's
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    with pytest.raises(ValueError, match="not whole blocks"):
        loader.dequantize_gguf(data[..., :-1], qtype)


def test_open_gguf_is_shared_and_follows_the_file(tmp_path):
    first = open_gguf(DEFAULT)
    assert open_gguf(os.path.relpath(DEFAULT)) is first
    assert loader._gguf_file(DEFAULT) is first
    path = write_tiny(tmp_path / "tiny.gguf")
    before = open_gguf(path)
    os.utime(path, ns=(1, 1))
    assert open_gguf(path) is not before


# ---------------------------------------------------------------- round trips

def write_tiny(path, alignment: int | None = 64, tensors: bool = True) -> str:
    """A small GGUF holding every metadata value type and plain and quantized tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype) in SCALARS.items():
        writer.add_key_value(key, value, vtype)
    for key, (values, subtype) in ARRAYS.items():
        writer.add_key_value(key, values, VT.ARRAY, sub_type=subtype)
    for key, values in NESTED.items():
        writer.add_key_value(key, values, VT.ARRAY)
    if tensors:
        for name, (array, qtype) in TENSORS.items():
            data = array if qtype in (QT.F32, QT.F16) else gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


SCALARS = {
    "t.u8": (200, VT.UINT8), "t.i8": (-100, VT.INT8), "t.u16": (60000, VT.UINT16),
    "t.i16": (-30000, VT.INT16), "t.u32": (4_000_000_000, VT.UINT32),
    "t.i32": (-2_000_000_000, VT.INT32), "t.f32": (1.5, VT.FLOAT32), "t.u64": (2**63 + 5, VT.UINT64),
    "t.i64": (-(2**62), VT.INT64), "t.f64": (math.pi, VT.FLOAT64), "t.true": (True, VT.BOOL),
    "t.false": (False, VT.BOOL), "t.str": ("héllo 日本語 😀 \x00 end", VT.STRING),
    "t.empty_str": ("", VT.STRING),
}
ARRAYS = {
    "a.u8": ([0, 1, 255], VT.UINT8), "a.i8": ([-128, 127], VT.INT8),
    "a.u16": ([1, 65535], VT.UINT16), "a.i16": ([-32768, 5], VT.INT16),
    "a.u32": ([7, 2**32 - 1], VT.UINT32), "a.i32": ([-1, 2**31 - 1], VT.INT32),
    "a.f32": ([0.25, -2.5, 1e-3], VT.FLOAT32), "a.u64": ([2**64 - 1], VT.UINT64),
    "a.i64": ([-(2**63), 3], VT.INT64), "a.f64": ([math.e, -0.0], VT.FLOAT64),
    "a.bool": ([True, False, True], VT.BOOL),
    "a.str": (["", "ascii", "ünïcödé", "中文", "👨‍👩‍👧", "tab\tnew\nline"], VT.STRING),
}
NESTED = {
    "n.ints": [[1, 2], [3]],
    "n.strs": [["a", "ß"], ["😀"]],
    "n.deep": [[[1]], [[2, 3], [4]]],
}
_rng = np.random.default_rng(0)
TENSORS = {
    "f32.weight": (_rng.standard_normal((3, 4)).astype(np.float32), QT.F32),
    "f16.weight": (_rng.standard_normal((2, 8)).astype(np.float16), QT.F16),
    "norm.weight": (_rng.standard_normal(5).astype(np.float32), QT.F32),
    "q8.weight": (_rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0),
    "q4_1.weight": (_rng.standard_normal((3, 32)).astype(np.float32), QT.Q4_1),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_round_trip_of_every_value_type(tiny):
    ours = GGUFFile(tiny)
    assert ours.version == 3 and ours.alignment == 64 and ours.data_offset % 64 == 0
    for key, (value, _) in SCALARS.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    for key, (values, subtype) in ARRAYS.items():
        got = ours.fields[key]
        if subtype == VT.STRING:
            assert got == values
        else:
            expected = np.array(values, dtype=gguf_file_mod._DTYPES[subtype])
            assert got.dtype == expected.dtype and got.tolist() == expected.tolist(), key
            assert got.flags.writeable  # a copy: it outlives the mapping
    assert [a.tolist() for a in ours.fields["n.ints"]] == NESTED["n.ints"]
    assert ours.fields["n.strs"] == NESTED["n.strs"]
    assert [[a.tolist() for a in inner] for inner in ours.fields["n.deep"]] == NESTED["n.deep"]
    assert ours.fields["n.ints"][0].dtype == np.int32


def test_round_trip_matches_gguf_reader(tiny):
    # GGUFReader's contents() cannot read nested arrays (its own FIXME), so they are left out.
    assert_matches_reader(GGUFFile(tiny), gguf.GGUFReader(tiny), skip=NESTED)


def test_round_trip_of_tensors(tiny):
    tensors = {t.name: t for t in GGUFFile(tiny).tensors}
    assert list(tensors) == list(TENSORS)
    for name, (array, qtype) in TENSORS.items():
        t = tensors[name]
        assert t.tensor_type == qtype and t.shape == array.shape
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        if qtype in (QT.F32, QT.F16):
            assert np.array_equal(got, array.astype(np.float32))
        else:  # the file holds the quantized blocks: compare with their own dequantization
            expected = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
            assert np.array_equal(got, expected)
            assert np.allclose(got, array, atol=0.3)


def test_default_alignment_and_no_tensors(tmp_path):
    ours = GGUFFile(write_tiny(tmp_path / "plain.gguf", alignment=None, tensors=False))
    assert ours.alignment == 32 and ours.tensors == []
    assert "general.alignment" not in ours.fields


# ---------------------------------------------------------------- hand-built files

def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _file(version: int, kvs: list[bytes], tensor_infos: list[bytes] = (), data: bytes = b"") -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensor_infos), len(kvs))
    body = head + b"".join(kvs) + b"".join(tensor_infos)
    return body + b"\0" * (-len(body) % 32) + data


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor_info(name: str, dims, qtype: int, offset: int = 0) -> bytes:
    return (_str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", qtype, offset))


def _parse(tmp_path, blob: bytes) -> GGUFFile:
    path = tmp_path / "x.gguf"
    path.write_bytes(blob)
    return GGUFFile(path)


def test_version_2_and_empty_arrays(tmp_path):
    kvs = [_kv("empty.u32", 9, struct.pack("<IQ", 4, 0)), _kv("empty.str", 9, struct.pack("<IQ", 8, 0)),
           _kv("one.str", 9, struct.pack("<IQ", 8, 1) + _str("x"))]
    data = np.arange(4, dtype=np.float32).tobytes()
    ours = _parse(tmp_path, _file(2, kvs, [_tensor_info("w", [4], 0)], data))
    assert ours.version == 2
    assert ours.fields["empty.u32"].dtype == np.uint32 and ours.fields["empty.u32"].size == 0
    assert ours.fields["empty.str"] == [] and ours.fields["one.str"] == ["x"]
    assert gguf.quants.dequantize(ours.tensors[0].data, ours.tensors[0].tensor_type).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("blob, message", [
    (b"", "empty file"),
    (b"GG", "not a GGUF"),
    (b"PK\x03\x04" + b"\0" * 64, "not a GGUF"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1 is not supported"),
    (b"GGUF" + struct.pack("<IQQ", 4, 0, 0), "version 4 is not supported"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (b"GGUF" + struct.pack("<I", 3), "truncated"),
    (_file(3, [_kv("k", 13, b"\0" * 8)]), "unknown metadata value type 13"),
    (_file(3, [_kv("k", 9, struct.pack("<IQ", 13, 1))]), "unknown metadata array type 13"),
    (_file(3, [_kv("k", 8, struct.pack("<Q", 2) + b"\xff\xfe")]), "not UTF-8"),
    (_file(3, [_kv("k", 9, struct.pack("<IQ", 8, 1) + _str("ok")[:8] + b"\xc3")]), "not UTF-8"),
    (_file(3, [_kv("k", 4, b"\0" * 4), _kv("k", 4, b"\0" * 4)]), "duplicate metadata key"),
    (_file(3, [_kv("general.alignment", 4, struct.pack("<I", 0))]), "bad general.alignment"),
    (_file(3, [_kv("k", 9, struct.pack("<IQ", 4, 2**40))]), "truncated"),
    (_file(3, [_kv("k", 9, struct.pack("<IQ", 8, 2**40))]), "truncated"),
    (_file(3, [_kv("k", 9, (struct.pack("<IQ", 9, 1)) * 40)]), "nested over"),
    (_file(3, [], [_tensor_info("w", [4], 99)], b"\0" * 16), "unknown ggml type 99"),
    (_file(3, [], [_tensor_info("w", [4, 2], 0)], b"\0" * 16), "truncated"),
    (_file(3, [], [_tensor_info("w", [40], 2)], b"\0" * 64), "do not fit Q4_0 blocks"),
    (_file(3, [], [_tensor_info("w", [], 0)]), "do not fit"),
    (_file(3, [], [_tensor_info("w", [1], 0), _tensor_info("w", [1], 0, 32)], b"\0" * 64),
     "duplicate tensor"),
])
def test_bad_files_raise_value_error(tmp_path, blob, message):
    with pytest.raises(ValueError, match=message):
        _parse(tmp_path, blob)


def test_every_truncation_raises_value_error(tmp_path, tiny):
    blob = open(tiny, "rb").read()
    end_of_infos = GGUFFile(tiny).data_offset
    # Every cut through the header, metadata and tensor infos, then cuts through the data.
    for cut in [*range(end_of_infos), *range(end_of_infos, len(blob), 7)]:
        with pytest.raises(ValueError):
            _parse(tmp_path, blob[:cut])


def test_truncated_default_model_raises_value_error(tmp_path):
    with open(DEFAULT, "rb") as f:
        head = f.read(400_000)  # ends inside the vocabulary
    with pytest.raises(ValueError, match="truncated"):
        _parse(tmp_path, head)


# ---------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello world, this is fine.",
    "  leading spaces\n\n\ttabs and newlines  ",
    "def f(x):\n    return x ** 2  # 12345 1234567",
    "Emoji: 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Ünïcödé àccents — “quotes” … ½ ≤ ∑",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|im_start|>assistant",
    "<|im_start|> not<|im_end|>special <|im_start",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語 😀"},
     {"role": "assistant", "content": "OK."}, {"role": "user", "content": "<|im_end|> again"}],
]


@pytest.fixture(scope="module")
def transformers_tokenizer():
    """What the runtime used to build: transformers parsing the file itself."""
    return AutoTokenizer.from_pretrained(os.path.dirname(DEFAULT), gguf_file=os.path.basename(DEFAULT),
                                         local_files_only=True)


def saved(hf, folder) -> dict:
    """The files save_pretrained writes. from_pretrained also records the load call's own
    `is_local` / `local_files_only` kwargs in tokenizer_config.json; they are not tokenizer state."""
    hf.save_pretrained(folder)
    files = {name: open(os.path.join(folder, name), encoding="utf-8").read()
             for name in sorted(os.listdir(folder))}
    config = json.loads(files.pop("tokenizer_config.json"))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    return {**files, "tokenizer_config.json": config}


def assert_same_tokenizer(ours, theirs, texts=TEXTS, conversations=CONVERSATIONS) -> None:
    assert type(ours) is type(theirs)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    for text in texts:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                decoded = theirs.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == decoded
    for messages in conversations if theirs.chat_template else ():
        for prompt in (True, False):
            kwargs = dict(tokenize=False, add_generation_prompt=prompt)
            rendered = theirs.apply_chat_template(messages, **kwargs)
            assert ours.apply_chat_template(messages, **kwargs) == rendered


def test_tokenizer_from_shared_parse_equals_transformers(transformers_tokenizer, tmp_path):
    ours = tokenizer_mod._convert_gguf(DEFAULT)
    assert_same_tokenizer(ours, transformers_tokenizer)
    assert ours.name_or_path == transformers_tokenizer.name_or_path
    assert saved(ours, tmp_path / "ours") == saved(transformers_tokenizer, tmp_path / "theirs")


def test_runtime_tokenizer_cold_and_cached_equal_transformers(transformers_tokenizer, tmp_path):
    reference = Tokenizer(transformers_tokenizer)
    for attempt in ("cold", "cached"):
        tok = load_tokenizer(DEFAULT, cache_dir=tmp_path)
        assert_same_tokenizer(tok.hf, transformers_tokenizer)
        for text in TEXTS:
            assert tok.encode(text) == reference.encode(text)
            ids = reference.encode(text)
            assert tok.decode(ids) == reference.decode(ids), attempt
        for messages in CONVERSATIONS:
            assert tok.render_chat(messages) == reference.render_chat(messages)
            assert tok.apply_chat_template(messages) == reference.apply_chat_template(messages)
        assert (tok.bos_token_id, tok.eos_token_id, tok.all_special_ids, tok.vocab_size) == (
            reference.bos_token_id, reference.eos_token_id, reference.all_special_ids,
            reference.vocab_size)


def test_first_load_parses_the_file_once(tmp_path, monkeypatch):
    """Tokenizer, config and weights of a first run share one parse; gguf.GGUFReader (which
    transformers' own conversion would use) is never involved."""
    def no_reader(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader was used")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    gguf_file_mod._open_cached.cache_clear()
    load_tokenizer(DEFAULT, cache_dir=tmp_path)
    loader.load_model_config(DEFAULT)
    next(loader.iter_weights(DEFAULT))
    info = gguf_file_mod._open_cached.cache_info()
    assert (info.misses, info.hits) == (1, 3)


def write_tokenizer_gguf(path, arch: str, kind: str, name: str = "tiny") -> str:
    """A metadata-only GGUF whose tokenizer exercises the conversion: a byte-level BPE with
    merges, control and user-defined tokens, or a sentencepiece vocabulary with byte tokens."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    if kind == "gpt2":
        letters = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in "ab"]
        tokens = ["<|endoftext|>", "Ġ", "a", "b", "Ġa", "ab", "Ġab", "<|im_start|>", "<think>", *letters]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm" if arch == "llama" else arch)
        writer.add_token_list(tokens)
        writer.add_token_types([3, 1, 1, 1, 1, 1, 1, 3, 4] + [1] * len(letters))
        writer.add_token_merges(["Ġ a", "a b", "Ġ ab"])
        writer.add_bos_token_id(7)
        writer.add_eos_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    else:
        pieces = ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "é", "<think>"]
        tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


TINY_TEXTS = ["ab a b", " ab é<think>x", "<s>a</s> b", "<|im_start|>ab<|endoftext|>", "  ab\n", "ü"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_tokenizers_equal_transformers(tmp_path, kind):
    from transformers.integrations.gguf import get_gguf_tokenizer

    path = write_tokenizer_gguf(tmp_path / "tiny.gguf", "llama", kind)
    mapping = tokenizer_mod._gguf_converter()[0]
    assert tokenizer_mod._gguf_tokenizer_inputs(open_gguf(path), mapping) == get_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", local_files_only=True)
    ours = tokenizer_mod._convert_gguf(path)
    assert_same_tokenizer(ours, theirs, TINY_TEXTS, [[{"role": "user", "content": "ab"}]])
    assert saved(ours, tmp_path / "ours") == saved(theirs, tmp_path / "theirs")


@pytest.mark.parametrize("arch, name", [("qwen2", "tiny"), ("qwen3", "tiny"),
                                        ("llama", "Mistral-7B")])
def test_other_tokenizer_classes_go_through_transformers(tmp_path, arch, name):
    """transformers may give these another tokenizer class (qwen2, qwen3: Qwen2Tokenizer; a
    llama file named after Mistral reads as mistral), so they keep its full conversion."""
    path = write_tokenizer_gguf(tmp_path / "tiny.gguf", arch, "gpt2", name)
    assert not tokenizer_mod._direct_conversion_applies(open_gguf(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", local_files_only=True)
    assert_same_tokenizer(tokenizer_mod._convert_gguf(path), theirs, TINY_TEXTS)
    for attempt in ("cold", "cached"):  # a cached entry of another class loads as that class
        tok = load_tokenizer(path, cache_dir=tmp_path / "cache")
        assert_same_tokenizer(tok.hf, theirs, TINY_TEXTS)


def test_a_cached_gguf_tokenizer_loads_without_indexing_transformers_models(tmp_path):
    """The default model's tokenizer, once cached, loads as its own class: AutoTokenizer (whose
    import indexes every transformers model package, a cold-start cost) is never imported."""
    load_tokenizer(DEFAULT, cache_dir=tmp_path)
    code = ("import sys\n"
            "from tierserve.runtime.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({DEFAULT!r}, cache_dir={str(tmp_path)!r})\n"
            "assert type(tok.hf).__name__ == 'TokenizersBackend', type(tok.hf)\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
