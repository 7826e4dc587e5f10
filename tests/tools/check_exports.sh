#!/bin/sh
# The shared library exports the public API only: every defined dynamic
# symbol starts with "stepq_" (internal stepq__ names and everything else are hidden).
lib="$1"
command -v nm >/dev/null 2>&1 || { echo "nm not installed: skipped"; exit 77; }
syms=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ {print $3}')
[ -n "$syms" ] || { echo "FAIL: no exported symbols in $lib"; exit 1; }
# Internal stepq__ names fail this too: the character after "stepq_" is "_".
bad=$(printf '%s\n' "$syms" | grep -v '^stepq_[a-z0-9]' || true)
n=$(printf '%s\n' "$syms" | wc -l)
if [ -n "$bad" ]; then
    echo "FAIL: non-public symbols exported:"; printf '%s\n' $bad
    exit 1
fi
for s in stepq_strerror stepq_map_load_file stepq_pool_open stepq_pool_decode_step \
    stepq_pool_prefill_pack stepq_pool_prefill_unpack stepq_pool_supports stepq_pool_conv_state \
    stepq_plugin_get stepq_set_logger \
    stepq_tp_shard stepq_map_shard stepq_tp_plan stepq_tp_fingerprint stepq_tp_msg_decode \
    stepq_tp_comm_init stepq_tp_comm_wrap stepq_tp_check_pools stepq_tp_exchange_slots \
    stepq_tp_send_slots stepq_tp_recv_slots; do
    printf '%s\n' "$syms" | grep -qx "$s" || { echo "FAIL: $s is not exported"; exit 1; }
done
echo "ok: $n public symbols exported, all stepq_*"
