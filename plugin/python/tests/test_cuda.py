"""The CUDA backend through the package, with torch tensors: decode, pack,
unpack and extend on a CUDA pool against the host pool of the same map (fp32
map: equal up to float rounding) and against the dense step (stepq@6: one
re-quantization's bound), on torch's current stream; the pool operations
with device pages. Skips without torch, a CUDA device or a CUDA build."""

import sys

import _harness

import stepq

EXACT = 1e-5  # fp32 rounding; the GPU sums in another order than the host
BOUND_6 = 3.0 / 31  # one re-quantization at 6 bits (test_decode.py's bound)


def _torch():
    try:
        import torch
    except ImportError:
        _harness.skip("torch is not installed")
    if not torch.cuda.is_available():
        _harness.skip("torch sees no CUDA device")
    return torch


def _pools(name, arch="gdn"):
    """A CUDA pool and a host pool of one map, 3 slots allocated in each (the same ids)."""
    with stepq.load_map(_harness.data("config", "calibrated", "tiny-" + arch, name)) as m:
        try:
            cuda = stepq.StatePool(m, size=4, device="cuda")
        except stepq.StepqError as e:
            if e.name in ("STEPQ_ENOTSUP", "STEPQ_ENODEV"):
                _harness.skip("no CUDA pool: %s" % e)
            raise
        host = stepq.StatePool(m, size=4)
    ids = cuda.alloc(3)
    assert host.alloc(3) == ids
    return cuda, host, ids


def _rel(a, b):
    np = _harness.need_numpy()
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).sum() / (b ** 2).sum()))


def _inputs(np, rng, pool, B):
    H, HV, K, V = pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim
    g_shape = (B, HV, K) if pool.arch == "kda" else (B, HV)
    return dict(q=rng.standard_normal((B, H, K)).astype(np.float32),
                k=rng.standard_normal((B, H, K)).astype(np.float32),
                v=rng.standard_normal((B, HV, V)).astype(np.float32),
                a=rng.uniform(-4, 0, g_shape).astype(np.float32),
                b=rng.standard_normal((B, HV)).astype(np.float32),
                A_log=np.zeros(HV, np.float32),
                dt_bias=rng.uniform(-0.5, 0.5, g_shape[1:]).astype(np.float32))


def _fp32_map_matches_the_host(arch):
    torch = _torch()
    np = _harness.need_numpy()
    rng = np.random.default_rng(2)
    cuda, host, ids = _pools("fp32.json", arch)
    HV, K, V = host.num_v_heads, host.head_k_dim, host.head_v_dim
    s = rng.uniform(-0.05, 0.05, (3, HV, K, V)).astype(np.float32)
    d_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    host.pack(1, ids, s)
    cuda.pack(1, d_ids, torch.from_numpy(s).cuda())
    side = torch.cuda.Stream()
    for _ in range(4):
        t = _inputs(np, rng, host, 3)
        o_host = host.decode(1, cache_indices=ids, **t)
        d = {n: torch.from_numpy(x).cuda() for n, x in t.items()}
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the step goes on torch's current stream
            o_cuda = cuda.decode(1, cache_indices=d_ids, **d)
        side.synchronize()
        assert o_cuda.is_cuda and o_cuda.dtype == torch.float32
        assert _rel(o_cuda.cpu().numpy(), o_host) <= EXACT
    assert _rel(cuda.unpack(1, d_ids).cpu().numpy(), host.unpack(1, ids)) <= EXACT
    for p in (cuda, host):
        p.close(force=True)


def test_gdn_fp32_decode_on_cuda_matches_the_host():
    _fp32_map_matches_the_host("gdn")


def test_kda_fp32_decode_on_cuda_matches_the_host():
    _fp32_map_matches_the_host("kda")


def test_stepq6_on_cuda_is_the_dense_step_then_one_requantization():
    torch = _torch()
    np = _harness.need_numpy()
    rng = np.random.default_rng(4)
    cuda, host, ids = _pools("stepq@6.json")
    HV, K, V = cuda.num_v_heads, cuda.head_k_dim, cuda.head_v_dim
    d_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    cuda.pack(0, d_ids, torch.from_numpy(rng.uniform(-0.05, 0.05, (3, HV, K, V)).astype(np.float32)).cuda())
    # The dense step of the unpacked state: an fp32 host pool.
    with stepq.load_map(_harness.data("config", "calibrated", "tiny-gdn", "fp32.json")) as m:
        ref = stepq.StatePool(m, size=4)
    ref_ids = ref.alloc(3)
    for _ in range(3):
        S = cuda.unpack(0, d_ids)
        ref.pack(0, ref_ids, S.cpu().numpy())
        t = _inputs(np, rng, cuda, 3)
        o = cuda.decode(0, cache_indices=d_ids, **{n: torch.from_numpy(x).cuda() for n, x in t.items()})
        o_ref = ref.decode(0, cache_indices=ref_ids, **t)
        torch.cuda.synchronize()
        assert _rel(o.cpu().numpy(), o_ref) <= 1e-4
        assert _rel(cuda.unpack(0, d_ids).cpu().numpy(), ref.unpack(0, ref_ids)) <= BOUND_6
    for p in (cuda, host, ref):
        p.close(force=True)


def test_bf16_tensors_step_on_cuda():
    torch = _torch()
    np = _harness.need_numpy()
    rng = np.random.default_rng(6)
    cuda, host, ids = _pools("fp32.json")
    d_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    t = _inputs(np, rng, host, 3)
    o32 = cuda.decode(2, cache_indices=d_ids, **{n: torch.from_numpy(x).cuda() for n, x in t.items()})
    cuda.clear_slots(ids)
    bf = {n: torch.from_numpy(x).cuda().to(torch.bfloat16) for n, x in t.items()}
    o16 = cuda.decode(2, cache_indices=d_ids, **bf)
    assert o16.dtype == torch.bfloat16
    assert _rel(o16.float().cpu().numpy(), o32.cpu().numpy()) <= 0.02  # bf16 inputs, 2^-8 each
    with _harness.raises(ValueError, match="q: on cpu"):
        cuda.decode(2, cache_indices=d_ids, **dict(bf, q=bf["q"].cpu()))
    with _harness.raises(ValueError, match="cache_indices"):
        cuda.decode(2, cache_indices=ids, **bf)  # a host list on a CUDA pool
    for p in (cuda, host):
        p.close(force=True)


def test_cuda_pool_operations_move_device_pages():
    torch = _torch()
    np = _harness.need_numpy()
    rng = np.random.default_rng(8)
    cuda, host, ids = _pools("stepq@6.json")
    HV, K, V = cuda.num_v_heads, cuda.head_k_dim, cuda.head_v_dim
    d_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    cuda.pack(3, d_ids, torch.from_numpy(rng.uniform(-0.05, 0.05, (3, HV, K, V)).astype(np.float32)).cuda())
    saved = cuda.get_cpu_copy(ids)
    assert saved.shape == (3, cuda.page_bytes) and saved.any()
    states = cuda.unpack(3, d_ids).cpu()
    cuda.clear_slots(ids)
    assert not cuda.get_cpu_copy(ids).any()
    cuda.load_cpu_copy(saved, ids)
    assert torch.equal(cuda.unpack(3, d_ids).cpu(), states)
    # The same pages on the host backend unpack to what the CUDA pool unpacks,
    # up to the GPU's float order.
    host.load_cpu_copy(saved, ids)
    assert _rel(host.unpack(3, ids), states.numpy()) <= EXACT
    cuda.copy_from(ids[:1], ids[1:2])
    assert np.array_equal(cuda.get_cpu_copy(ids[1:2])[0], saved[0])
    ptrs, lens, items = cuda.get_contiguous_buf_infos()
    assert ptrs[0] == cuda.page_address(0) and items[0] == cuda.page_bytes
    assert lens[0] == (cuda.size + 1) * cuda.page_bytes
    # extend with torch tensors and a torch mask: the entry without a prefix starts at 0.
    seen = {}

    def chunk(s):
        seen["initial"] = s.clone()
        s.mul_(0.5)
        return s

    cuda.extend(3, d_ids, chunk, has_initial_state=torch.tensor([True, False, True]))
    init = seen["initial"]
    assert init.is_cuda and init.dtype == torch.float32
    assert not init[1].any() and init[0].abs().sum() > 0
    for p in (cuda, host):
        p.close(force=True)


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
