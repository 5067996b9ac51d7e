#!/usr/bin/env bash
# One twinkled per GPU, for many small tenants (docs/operator.md §5c): writes
# twinkled-<i>.toml for GPUs 0..N-1 from the main config (its device, port base+i and
# data dir <data_dir>/gpu<i>; every other setting kept) and the unit template
# twinkled@.service (the shipped unit, reading twinkled-%i.toml).
#
#   sudo ops/per-gpu.sh 4            # then: systemctl enable --now twinkled@{0..3}
#
# Paths (for tests and other layouts): CONFIG (/etc/twinkle/twinkled.toml), UNIT (the
# shipped ops/twinkled.service), UNIT_DIR (/etc/systemd/system).
set -euo pipefail
n="${1:?usage: per-gpu.sh NUMBER_OF_GPUS}"
config="${CONFIG:-/etc/twinkle/twinkled.toml}"
unit="${UNIT:-$(dirname "$0")/twinkled.service}"
unit_dir="${UNIT_DIR:-/etc/systemd/system}"
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "per-gpu.sh: not a number of GPUs: $n" >&2; exit 2; }
# The values each instance changes; the main config must set them (the shipped one does).
value() {
    sed -n "s/^$1 *= *//p" "$config" | head -1
}
for key in port data_dir devices; do
    grep -q "^$key *=" "$config" || { echo "per-gpu.sh: $config sets no $key" >&2; exit 2; }
done
if [ -n "$(value join_listen | tr -d '"')" ]; then
    echo "per-gpu.sh: $config sets join_listen: a daemon per GPU takes no other hosts" >&2
    exit 2
fi
port="$(value port)"
data_dir="$(value data_dir | tr -d '"')"
for ((i = 0; i < n; i++)); do
    sed -e "s|^devices *=.*|devices = [\"cuda:$i\"]|" -e "s|^port *=.*|port = $((port + i))|" \
        -e "s|^data_dir *=.*|data_dir = \"$data_dir/gpu$i\"|" \
        "$config" > "${config%.toml}-$i.toml"
    echo "wrote ${config%.toml}-$i.toml: cuda:$i, port $((port + i)), $data_dir/gpu$i"
done
sed -E -e "s|^(ExecStart=.* --config )[^ ]+|\1${config%.toml}-%i.toml|" \
    -e "s|^Description=.*|& (GPU %i)|" "$unit" > "$unit_dir/twinkled@.service"
echo "wrote $unit_dir/twinkled@.service"
