#!/usr/bin/env bash
# The peer benchmark on the offline GPU machine, from the repo root, with vLLM from the kit that
# ../shared/tools/vllm-kit/build.sh writes into .vlc/ (git-ignored): two parts of <= 55 MiB, one per device call.
# Each call stages the parts it carries in /tmp/vlkit_vlc/parts; once all are there (and checked against
# .vlc/SHA256SUMS) the kit is installed into /tmp/site_vlc (vLLM children only) and our extra wheels from .whl/ into
# /tmp/ours_site, and `python -m benchmarks.peers ARGS` runs. With a part still missing it says so and exits 0.
# KIT=.vlcm names another kit directory (say one built with the MoE binary kept, which needs a third part).
set -euo pipefail
KIT=${KIT:-.vlc}
R=$PWD K=/tmp/vlkit_${KIT#.} S=/tmp/site_${KIT#.} O=/tmp/ours_site
P=/opt/torch/.venv/bin/python3; [ -x "$P" ] || P=python3
mkdir -p $K/parts
cp -f $KIT/part0? $K/parts/ 2>/dev/null || true
if [ ! -f $S/vllm/__init__.py ]; then
  if ! (cd $K/parts && grep ' part0' "$R/$KIT/SHA256SUMS" | sha256sum -c --quiet 2>/dev/null); then
    echo "vLLM kit incomplete, staged: $(ls $K/parts | tr '\n' ' ')"; exit 0
  fi
  cat $K/parts/part0? | $P -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('$K',filter='data')"
  (cd $K && sha256sum -c --quiet MANIFEST.sha256)
  $P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $K/wheels/*.whl $K/vllm-0.25.0-*.whl
fi
# .vlcx/ (optional): wheels of vLLM dependencies the kit lacks, into vLLM's site too. vLLM imports
# lm-format-enforcer and outlines_core whenever it validates a structured-output request (json_decoding).
if [ -d .vlcx ] && [ ! -d $S/lmformatenforcer ]; then
  $P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .vlcx/*.whl
fi
if [ -d .whl ] && [ ! -d $O ]; then
  $P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $O .whl/*.whl
fi
export PYTHONPATH=$O PYTHONUNBUFFERED=1
exec $P -m benchmarks.peers --vllm-site $S "$@"
