#!/usr/bin/env bash
# Fetch uPlot from the npm registry (`npm pack`), check the tarball's sha256, and copy its
# minified script, stylesheet and licence into orchard/cluster/gateway/static/ (see VENDORED.md there).
set -euo pipefail
VERSION=1.6.32
SHA256=4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d
cd "$(dirname "$0")/.."
dest=orchard/cluster/gateway/static
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "uplot@$VERSION" >/dev/null)
echo "$SHA256  $tmp/uplot-$VERSION.tgz" | sha256sum -c --quiet -
tar -xzf "$tmp/uplot-$VERSION.tgz" -C "$tmp"
cp "$tmp/package/dist/uPlot.iife.min.js" "$tmp/package/dist/uPlot.min.css" "$dest/"
cp "$tmp/package/LICENSE" "$dest/uPlot.LICENSE"
echo "uPlot $VERSION copied into $dest; update the sums in $dest/VENDORED.md if the version changed"
