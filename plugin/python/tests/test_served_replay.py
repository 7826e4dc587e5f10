"""served_path.py's replay at the stepq boundary, without torch: the
recorder's bookkeeping (slot -> request across admissions and retirements,
slots coming back to other requests, padding and untracked rows), the wrapper
on one pool instance, and the replay and its comparator, on real host-backend
pools with numpy arrays (tiny-gdn's and tiny-kda's stepq@4 maps): a scheduled
batched run replays bit for bit at B = 1, and a recorded output one ulp off,
a page byte off or a missing call is reported where it is."""

import sys

import _harness

import stepq

def _served_path():
    return _harness.script("served_path")


def _map(arch, name="stepq@4.json"):
    return stepq.load_map(_harness.data("config", "calibrated", "tiny-" + arch, name))


def _unit(np, rng, shape):
    x = rng.uniform(-1, 1, shape)
    return (x / np.sqrt((x * x).sum(-1, keepdims=True))).astype(np.float32)


# Requests of the scheduled run: (rid, arrival step, decode steps, admitted by a fork of a running request).
PLAN = [(0, 0, 4, False), (1, 0, 2, False), (2, 1, 5, False), (3, 1, 3, False), (4, 3, 4, True),
        (5, 4, 2, False), (6, 5, 3, True)]
TRACKED = [0, 2, 3, 4, 6]  # 1 and 5 run untracked beside them


def _batched_run(sp, np, pool, recorder, rng, max_running=3, tensor=None, poison=None):
    """A continuous-batching loop on a host pool as batching_one runs it: FIFO admission (a pack of
    random states into every layer, or a copy of a running request's page), one decode call per layer
    per step over the running slots (a -1 padding row among them; q and k as strided views of one
    fused projection; the odd layers with A_log and dt_bias), a track copy now and then, retirement.
    The pool's decode is wrapped for the recorder. tensor: what the decode call is given (default the
    numpy arrays; torch.from_numpy for CPU torch tensors). poison: (step, layer): that call's first row
    gets a NaN in v (its head is left unchanged and its slot's health word gets STEPQ_HEALTH_INPUT).
    Returns rid -> decode steps run and the slots each request had."""
    tensor = tensor or (lambda x: x)
    H, HV, K, V, L = pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim, pool.n_layers
    kda = pool.arch == "kda"
    unwrap = sp.record_decode(pool, recorder)
    track = pool.alloc(1)[0]
    queue = list(PLAN)
    rows = []  # [rid, slot, steps left]
    steps_run, slots_of = {}, {}
    step = 0
    while queue or rows:
        while queue and queue[0][1] <= step and len(rows) < max_running:
            rid, _, n, fork = queue.pop(0)
            slot = pool.alloc(1)[0]
            if fork and rows:
                pool.copy_from([rows[0][1]], [slot])  # prefix copy-on-write from a running request
            else:
                for layer in range(L):
                    pool.pack(layer, [slot], (0.05 * rng.uniform(-1, 1, (1, HV, K, V))).astype(np.float32))
            recorder.join(rid, slot, pool)
            rows.append([rid, slot, n])
            steps_run[rid] = 0
            slots_of.setdefault(rid, []).append(slot)
        if not rows:
            step += 1
            continue
        ids = np.array([s for _, s, _ in rows[:1]] + [-1] + [s for _, s, _ in rows[1:]], dtype=np.int32)
        B = len(ids)
        for layer in range(L):
            fused = np.concatenate([_unit(np, rng, (B, H * K)), _unit(np, rng, (B, H * K))], axis=1)
            q, k = fused[:, :H * K], fused[:, H * K:]  # [B, H*K] rows 2*H*K apart
            v = rng.uniform(-1, 1, (B, HV, V)).astype(np.float32)
            g = rng.uniform(-0.2, 0, (B, HV, K) if kda else (B, HV)).astype(np.float32)
            beta = rng.uniform(0.1, 0.9, (B, HV)).astype(np.float32)
            out = np.full((B, HV, V), 7.0, dtype=np.float32)
            if poison == (step, layer):
                v[0, 1, 5] = np.nan
            gate = {}
            if layer % 2:  # the odd layers with the gating in the kernel: g, beta are the raw a, b
                gate = {"A_log": tensor(rng.uniform(-1, 0.5, HV).astype(np.float32)),
                        "dt_bias": tensor(rng.uniform(-0.5, 0.5, (HV, K) if kda else HV).astype(np.float32))}
            pool.decode(layer, *map(tensor, (q, k, v, g, beta)), cache_indices=tensor(ids), out=tensor(out),
                        l2norm=True, **gate)
        for x in rows:
            x[2] -= 1
            steps_run[x[0]] += 1
        if step % 2 == 0:
            pool.copy_from([rows[-1][1]], [track])  # a track copy: reads the working slot only
        keep = []
        for x in rows:
            if x[2] == 0:
                recorder.leave(x[0], x[1], pool)
                pool.free([x[1]])
            else:
                keep.append(x)
        rows = keep
        step += 1
    pool.free([track])
    unwrap()
    return steps_run, slots_of


def _scheduled(arch, torch=None, poison=None):
    np = _harness.need_numpy()
    sp = _served_path()
    rng = np.random.default_rng(3)
    with _map(arch) as m:
        pool = stepq.StatePool(m, size=4)  # 3 working slots and a track slot: slots come back to others
        replay_pool = stepq.StatePool(m, size=1)
    io = sp.NumpyIO() if torch is None else sp.TorchIO(torch, "cpu")
    rec = sp.DecodeRecorder(TRACKED, io)
    steps_run, slots_of = _batched_run(sp, np, pool, rec, rng, tensor=torch and torch.from_numpy, poison=poison)
    assert pool.available_size() == pool.size and "decode" not in pool.__dict__
    pool.close()
    return np, sp, io, rec, replay_pool, steps_run, slots_of


def test_the_recorder_follows_each_tracked_slot_across_admissions_and_retirements():
    np, sp, io, rec, replay_pool, steps_run, slots_of = _scheduled("gdn")
    L = replay_pool.n_layers
    tracked_slots = [s for rid in TRACKED for s in slots_of[rid]]
    assert len(set(tracked_slots)) < len(tracked_slots)  # a slot came back to another tracked request
    assert not rec.slot_rid  # every tracked request left
    assert sorted(rec.calls) == TRACKED and sorted(rec.admitted) == sorted(rec.freed) == TRACKED
    for rid in TRACKED:
        calls = rec.calls[rid]
        assert len(calls) == steps_run[rid] * L
        # In call order: every layer of step 0, then of step 1, ...
        assert [(c["step"], c["layer"]) for c in calls] == [(s, layer) for s in range(steps_run[rid])
                                                            for layer in range(L)]
        for c in calls:
            assert c["q"].shape == (1, replay_pool.num_k_heads * replay_pool.head_k_dim)
            assert c["out"].shape == (1, replay_pool.num_v_heads, replay_pool.head_v_dim)
            assert c["out"].dtype == np.float32 and c["l2norm"] is True and c["scale"] is None
            if c["layer"] % 2:
                assert c["A_log"].shape == (replay_pool.num_v_heads,) and c["dt_bias"] is not None
            else:
                assert c["A_log"] is None and c["dt_bias"] is None
            assert not (c["out"] == 7.0).all()  # the decode's output, not the buffer before the call
    assert rec.nbytes > 0
    replay_pool.close()


def test_a_scheduled_batched_run_replays_bit_for_bit_at_batch_one():
    for arch in ("gdn", "kda"):
        np, sp, io, rec, replay_pool, steps_run, _ = _scheduled(arch)
        rep = sp.replay(replay_pool, rec, io, {rid: steps_run[rid] for rid in TRACKED})
        assert rep["identical"] and rep["outputs_identical"] and rep["pages_identical"], rep
        assert rep["requests"] == len(TRACKED) and not rep["incomplete"] and not rep["requests_differing"]
        assert rep["calls"] == sum(steps_run[rid] for rid in TRACKED) * replay_pool.n_layers
        assert rep["elements"] == rep["calls"] * replay_pool.num_v_heads * replay_pool.head_v_dim
        assert rep["first_difference"] is None and rep["first_page_difference"] is None
        assert rep["per_request"] == {rid: (True, True, True) for rid in TRACKED}
        assert rep["health_identical"] and rep["first_health_difference"] is None
        assert replay_pool.available_size() == 1
        assert "identical" in sp.replay_summary(rep) and "DIFFER" not in sp.replay_summary(rep)
        replay_pool.close()


def test_one_output_one_ulp_off_is_reported_where_it_is():
    np, sp, io, rec, replay_pool, steps_run, _ = _scheduled("gdn")
    rid, c, h, e = 3, 7, 5, 100  # request 3's call 7: step 1 of layer 1 on tiny-gdn's 6 layers
    call = rec.calls[rid][c]
    was = float(call["out"][0, h, e])
    call["out"][0, h, e] = np.nextafter(call["out"][0, h, e], np.float32(np.inf))
    rep = sp.replay(replay_pool, rec, io, {r: steps_run[r] for r in TRACKED})
    assert not rep["identical"] and not rep["outputs_identical"] and rep["pages_identical"]
    assert rep["differing_elements"] == 1 and rep["differing_calls"] == 1 and rep["requests_differing"] == [rid]
    d = rep["first_difference"]
    assert (d["rid"], d["call"], d["step"], d["layer"]) == (rid, c, call["step"], call["layer"]) == (3, 7, 1, 1)
    assert d["index"] == [h, e] and d["element"] == h * replay_pool.head_v_dim + e
    assert d["replayed"] == was and d["batched"] == float(np.nextafter(np.float32(was), np.float32(np.inf)))
    assert d["batched"] != d["replayed"]
    assert rep["per_request"][rid] == (False, True, True)
    text = sp.replay_summary(rep)
    assert "DIFFER in 1 elements of 1 calls" in text and "request 3 step 1 layer 1 element [5, 100]" in text
    replay_pool.close()


def test_health_words_are_compared_and_a_non_finite_input_replays_to_the_same_word():
    """A NaN in one tracked request's v (step 2, layer 1: row 0 is request 0 then) raises
    STEPQ_HEALTH_INPUT in the batched run, and the replay on the recorded inputs raises it too: the
    words agree. A word the replay cannot produce (a SATURATED bit added to another request's record)
    is reported for that request alone, with both words."""
    np, sp, io, rec, replay_pool, steps_run, _ = _scheduled("gdn", poison=(2, 1))
    assert rec.admitted_health[0] == 0 and rec.freed_health[0] == stepq.HEALTH_INPUT
    assert all(rec.freed_health[r] == 0 for r in TRACKED if r != 0)
    expected = {r: steps_run[r] for r in TRACKED}
    rep = sp.replay(replay_pool, rec, io, expected)
    assert rep["identical"] and rep["health_identical"], sp.replay_summary(rep)
    rec.freed_health[3] |= stepq.HEALTH_SATURATED
    rep = sp.replay(replay_pool, rec, io, expected)
    assert rep["outputs_identical"] and rep["pages_identical"] and not rep["health_identical"]
    assert not rep["identical"] and rep["requests_differing"] == [3] and rep["per_request"][3] == (True, True, False)
    assert rep["first_health_difference"] == {"rid": 3, "admitted": 0, "batched": stepq.HEALTH_SATURATED,
                                              "replayed": 0}
    assert "health words DIFFER" in sp.replay_summary(rep) and "batched 0x4, replayed 0x0" in sp.replay_summary(rep)
    replay_pool.close()


def test_the_replay_runs_on_the_recorded_inputs():
    """An input moved after the batched call: that call's output and the request's page part from the
    record (a change of one ulp can round away in the step; 1e-4 on a row of v does not)."""
    np, sp, io, rec, replay_pool, steps_run, _ = _scheduled("gdn")
    call = rec.calls[2][3]
    call["v"][0, 0, :] += np.float32(1e-4)
    rep = sp.replay(replay_pool, rec, io, {r: steps_run[r] for r in TRACKED})
    d = rep["first_difference"]
    assert not rep["outputs_identical"] and (d["rid"], d["call"], d["index"]) == (2, 3, [0, 0])
    assert rep["requests_differing"] == [2] and rep["first_page_difference"]["rid"] == 2
    replay_pool.close()


def test_a_page_byte_off_and_a_missing_call_are_reported():
    np, sp, io, rec, replay_pool, steps_run, _ = _scheduled("kda")
    layout = replay_pool.layout()
    H = layout["n_local_heads"]
    block = 2 * H + 3  # layer 2, head 3
    byte = int(layout["block_offset"][block]) + 10
    rec.freed[4] = rec.freed[4].copy()
    rec.freed[4][0, byte] ^= 1
    expected = {r: steps_run[r] for r in TRACKED}
    expected[6] += 1  # one step more than request 6 ran: its record is incomplete
    rep = sp.replay(replay_pool, rec, io, expected)
    assert rep["outputs_identical"] and not rep["pages_identical"] and not rep["identical"]
    p = rep["first_page_difference"]
    assert (p["rid"], p["byte"], p["bytes_differing"]) == (4, byte, 1) and p["batched"] ^ p["replayed"] == 1
    assert p["where"] == "layer 2 head 3 (byte 10 of the block)"
    assert rep["incomplete"] == [6] and rep["requests_differing"] == [4]
    assert "final pages DIFFER" in sp.replay_summary(rep) and "incomplete record (6)" in sp.replay_summary(rep)
    replay_pool.close()


def test_cpu_torch_tensors_record_and_replay_as_numpy_arrays_do():
    """TorchIO, served_path's side for torch, on CPU tensors of a host pool (skips without torch): the
    same run records the same rows (one host copy per call, split back) and replays identically; an
    output one ulp off is found."""
    try:
        import torch
    except ImportError:
        _harness.skip("torch is not installed for %s" % sys.executable)
    np, sp, io, rec, replay_pool, steps_run, _ = _scheduled("kda", torch)
    np_, sp_, io_np, rec_np, replay_np, steps_np, _ = _scheduled("kda")
    assert steps_run == steps_np and rec.nbytes == rec_np.nbytes
    for rid in TRACKED:
        for c, c_np in zip(rec.calls[rid], rec_np.calls[rid]):
            assert isinstance(c["q"], torch.Tensor) and c["q"].device.type == "cpu"
            for n in sp.ROW_ARGS + ("out",):
                assert tuple(c[n].shape) == c_np[n].shape and (c[n].numpy() == c_np[n]).all(), n
    expected = {r: steps_run[r] for r in TRACKED}
    rep = sp.replay(replay_pool, rec, io, expected)
    assert rep["identical"] and rep["calls"] == sum(expected.values()) * replay_pool.n_layers, rep
    out = rec.calls[6][2]["out"]
    out[0, 1, 2] = float(np.nextafter(np.float32(out[0, 1, 2].item()), np.float32(-np.inf)))
    rep = sp.replay(replay_pool, rec, io, expected)
    d = rep["first_difference"]
    assert rep["differing_elements"] == 1 and (d["rid"], d["call"], d["index"]) == (6, 2, [1, 2])
    replay_pool.close()
    replay_np.close()


def test_the_bit_comparator_tells_signed_zeros_apart_and_nans_by_their_bits():
    np = _harness.need_numpy()
    sp = _served_path()
    io = sp.NumpyIO()
    a = np.array([[1.0, 0.0, np.nan, 2.0]], dtype=np.float32)
    assert sp.first_bit_difference(a, a.copy(), io) == (0, None, None, None)
    b = a.copy()
    b[0, 1] = -0.0
    b[0, 3] = np.nextafter(np.float32(2.0), np.float32(0))
    n, i, want, got = sp.first_bit_difference(a, b, io)
    assert (n, i, want) == (2, 1, 0.0) and got == 0.0 and str(got) == "-0.0"
    with _harness.raises(ValueError, match="shapes"):
        sp.first_bit_difference(a, a[:, :2], io)


def test_the_recorder_refuses_a_slot_held_twice_and_a_wrong_leave_and_ignores_the_untracked():
    np = _harness.need_numpy()
    sp = _served_path()
    with _map("gdn", "fp32.json") as m:
        pool = stepq.StatePool(m, size=3)
        other = stepq.StatePool(m, size=1)
    rec = sp.DecodeRecorder([1, 2], sp.NumpyIO())
    s = pool.alloc(3)
    rec.join(1, s[0], pool)
    rec.join(9, s[0], pool)  # untracked: no mapping, no page read
    assert rec.slot_rid == {s[0]: 1} and sorted(rec.admitted) == [1]
    with _harness.raises(RuntimeError, match="while request 1 holds it"):
        rec.join(2, s[0], pool)
    with _harness.raises(RuntimeError, match="admitted twice"):
        rec.join(1, s[1], pool)
    with _harness.raises(RuntimeError, match="maps to 1"):
        rec.leave(2, s[0], pool)
    # The wrapper sits on this instance only; rows of untracked slots are not recorded.
    unwrap = sp.record_decode(pool, rec)
    assert "decode" in pool.__dict__ and "decode" not in other.__dict__
    H, HV, K, V = pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim
    z = lambda *shape: np.full(shape, 0.1, dtype=np.float32)
    pool.decode(0, z(2, H, K), z(2, H, K), z(2, HV, V), z(2, HV), z(2, HV), cache_indices=[s[2], s[1]])
    assert rec.calls[1] == [] and rec.nbytes == 0
    out = pool.decode(3, z(2, H, K), z(2, H, K), z(2, HV, V), z(2, HV), z(2, HV),
                      cache_indices=np.array([s[2], s[0]], dtype=np.int32), scale=0.5, l2norm=False)
    assert [(c["layer"], c["step"], c["scale"], c["l2norm"]) for c in rec.calls[1]] == [(3, 0, 0.5, False)]
    assert (rec.calls[1][0]["out"] == out[1:2]).all()
    rec.leave(1, s[0], pool)
    assert rec.slot_rid == {} and sorted(rec.freed) == [1]
    unwrap()
    assert "decode" not in pool.__dict__
    pool.free(s)
    pool.close()
    other.close()


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
