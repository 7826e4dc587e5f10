#!/usr/bin/env python3
"""Regenerates tests/calib/corpus: small safetensors traces, ok-* (must load as a trace set)
and bad-* (must be rejected). Run from anywhere: python3 tests/calib/make_corpus.py"""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
META = {"format": "stepq-trace", "version": "1", "arch": "gdn", "H": "1", "HV": "2", "K": "2", "V": "2",
        "qk_heads": "H", "qk_l2norm": "1", "scale": "0.7071", "all_layers": "0", "layers": "0",
        "stream_offset": "0", "n_streams": "1", "streams_total": "1", "seq_len": "2"}
# name, dtype, shape
TENS = [("layer0.q", "F32", [1, 2, 1, 2]), ("layer0.k", "F32", [1, 2, 1, 2]), ("layer0.v", "BF16", [1, 2, 2, 2]),
        ("layer0.g", "F32", [1, 2, 2]), ("layer0.beta", "F16", [1, 2, 2])]
ES = {"F32": 4, "BF16": 2, "F16": 2}


def build(meta=META, tens=TENS, header_edit=None, data_edit=None, raw_header=None, pad=True):
    h = {"__metadata__": dict(meta)}
    off = 0
    data = b""
    for name, dt, shape in tens:
        n = ES.get(dt, 4)
        for d in shape:
            n *= d
        h[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes((i * 7 + len(name)) % 61 for i in range(n)) if dt != "F32" else \
            b"".join(struct.pack("<f", 0.25 * (i + 1)) for i in range(n // 4))
        off += n
    if header_edit:
        header_edit(h)
    hj = raw_header if raw_header is not None else json.dumps(h).encode()
    if pad:
        hj += b" " * ((8 - len(hj) % 8) % 8)
    if data_edit:
        data = data_edit(data)
    return struct.pack("<Q", len(hj)) + hj + data


def tensor(h, name):
    return h[name]


def main():
    os.makedirs(HERE, exist_ok=True)
    for f in os.listdir(HERE):
        os.remove(os.path.join(HERE, f))
    cases = {}
    cases["ok-000-minimal"] = build()
    cases["ok-001-no-padding"] = build(pad=False)
    m = dict(META, arch="kda")
    cases["ok-002-kda"] = build(meta=m, tens=[t if t[0] != "layer0.g" else ("layer0.g", "F32", [1, 2, 2, 2])
                                              for t in TENS])
    cases["bad-000-empty"] = b""
    cases["bad-001-short-length"] = b"\x10\x00\x00"
    cases["bad-002-header-longer-than-file"] = struct.pack("<Q", 4096) + b"{}"
    cases["bad-003-header-too-large"] = struct.pack("<Q", 1 << 40) + b"{}"
    cases["bad-004-truncated-data"] = build()[:-3]
    cases["bad-005-trailing-data"] = build() + b"\0\0\0\0"
    cases["bad-006-not-json"] = build(raw_header=b"{not json}")
    cases["bad-007-invalid-utf8"] = build(raw_header=b'{"__metadata__": {"x": "\xff"}}')
    cases["bad-008-overlong-utf8"] = build(raw_header=b'{"__metadata__": {"x": "\xc0\xaf"}}')
    cases["bad-009-root-array"] = build(raw_header=b"[]")
    cases["bad-010-nul-in-header"] = build(raw_header=b'{"a\x00": 1}')

    def e(f):
        return lambda h: f(h)
    cases["bad-011-unknown-dtype"] = build(header_edit=lambda h: h["layer0.q"].update(dtype="I64"))
    cases["bad-012-span-mismatch"] = build(header_edit=lambda h: h["layer0.q"].update(shape=[1, 2, 1, 3]))
    cases["bad-013-overlap"] = build(header_edit=lambda h: h["layer0.k"].update(
        data_offsets=[h["layer0.q"]["data_offsets"][0], h["layer0.q"]["data_offsets"][1]]))
    cases["bad-014-misaligned"] = build(tens=[("layer0.beta", "F16", [1, 2, 2]), ("layer0.q", "F32", [1, 2, 1, 2])],
                                        header_edit=lambda h: (h["layer0.beta"].update(shape=[1, 1, 1], data_offsets=[0, 2]),
                                                               h["layer0.q"].update(data_offsets=[2, 18])),
                                        data_edit=lambda d: d[:2] + d[8:24])
    cases["bad-015-offset-beyond-data"] = build(header_edit=lambda h: h["layer0.beta"].update(
        data_offsets=[h["layer0.beta"]["data_offsets"][0] + 1000, h["layer0.beta"]["data_offsets"][1] + 1000]))
    cases["bad-016-negative-dim"] = build(header_edit=lambda h: h["layer0.q"].update(shape=[1, -2, 1, 2]))
    cases["bad-017-fractional-offset"] = build(header_edit=lambda h: h["layer0.q"].update(data_offsets=[0.5, 16.5]))
    cases["bad-018-missing-shape"] = build(header_edit=lambda h: h["layer0.q"].pop("shape"))
    cases["bad-019-extra-key"] = build(header_edit=lambda h: h["layer0.q"].update(strides=[1]))
    cases["bad-020-metadata-not-string"] = build(header_edit=lambda h: h["__metadata__"].update(H=1))
    cases["bad-021-duplicate-tensor"] = build(raw_header=json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})[:-1].encode()
                                              + b', "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                                              data_edit=lambda d: b"\0" * 8)
    cases["bad-022-wrong-format"] = build(meta=dict(META, format="other"))
    cases["bad-023-missing-tensor"] = build(tens=TENS[:-1])
    cases["bad-024-wrong-shape"] = build(tens=[t if t[0] != "layer0.v" else ("layer0.v", "BF16", [1, 2, 2, 3])
                                               for t in TENS])
    cases["bad-025-hv-not-multiple"] = build(meta=dict(META, H="3"))
    cases["bad-026-layers-not-increasing"] = build(meta=dict(META, all_layers="1,0", layers="0"))
    cases["bad-027-streams-beyond-total"] = build(meta=dict(META, stream_offset="1"))
    cases["bad-028-extra-tensor"] = build(tens=TENS + [("layer0.x", "F32", [1])])
    cases["bad-029-huge-shape"] = build(header_edit=lambda h: h["layer0.q"].update(shape=[2 ** 40, 2 ** 40, 1, 2]))
    cases["ok-003-subset-of-streams"] = build(meta=dict(META, streams_total="2", stream_offset="1"))
    cases["bad-030-stream-misses-a-layer"] = build(meta=dict(META, all_layers="0,1"))
    cases["bad-031-scale-not-number"] = build(meta=dict(META, scale="abc"))
    cases["bad-032-qk-heads-bad"] = build(meta=dict(META, qk_heads="K"))
    # Non-finite values (data: q at 0, k 16, v 32 in BF16, g 48, beta 64 in F16).
    def put(at, b):
        return lambda d: d[:at] + b + d[at + len(b):]
    cases["bad-033-nan-in-f32-q"] = build(data_edit=put(4, struct.pack("<f", float("nan"))))
    cases["bad-034-nan-in-bf16-v"] = build(data_edit=put(34, b"\xc0\x7f"))
    cases["bad-035-inf-in-f16-beta"] = build(data_edit=put(66, struct.pack("<e", float("inf"))))
    for name, blob in cases.items():
        with open(os.path.join(HERE, name + ".safetensors"), "wb") as f:
            f.write(blob)
    print("%d files in %s" % (len(cases), HERE))


if __name__ == "__main__":
    main()
