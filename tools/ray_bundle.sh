#!/usr/bin/env bash
# Ray Serve for the device machines, which have no Ray and take at most 64 MiB of working tree a call (issue 29: the
# fleet over two `vla-rt serve --ray` replicas). Ray's own wheel is 79 MB (2.60.0, cp312), so a wheel cannot travel;
# this packs ray[serve] installed for the image's Python 3.12, without what the run never loads (the Java jar, the
# dashboard's web client) and without the packages the device image already holds (KINDS.md's list), into one xz
# archive of ~48 MB:
#   bash tools/ray_bundle.sh                 # writes .raybundle/ray-serve-<version>-cp312.tar.xz (git-ignored)
# and on the device, with carry=[".whl", ".raybundle"], before anything imports ray:
#   mkdir -p /tmp/site && tar xJf .raybundle/ray-serve-*.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
set -euo pipefail
VERSION=${RAY_VERSION:-2.60.0}
OUT_DIR=.raybundle
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip install -q --target "$WORK/site" --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "ray[serve]==$VERSION" 2>&1 | grep -v -e "^WARNING" -e "dependency resolver" -e "requires .* but you have" || true
cd "$WORK/site"
# on the device image already (KINDS.md, read 2026-11-17): two copies of a package break imports there
ON_IMAGE="aiohappyeyeballs aiohttp aiosignal anyio attr attrs certifi charset_normalizer click filelock frozenlist
  fsspec grpc h11 httpcore httpx idna jinja2 markupsafe msgpack multidict numpy numpy.libs packaging prometheus_client
  propcache google/protobuf psutil yaml _yaml requests rich six typing_extensions urllib3 uvloop wrapt yarl
  pygments markdown_it mdurl"
for name in $ON_IMAGE; do
  rm -rf "./$name" ./"${name//\//_}"-*.dist-info
  dist=$(echo "$name" | tr '_' '-')
  rm -rf ./"$name"-*.dist-info ./"$dist"-*.dist-info 2>/dev/null || true
done
rm -rf ./*protobuf*.dist-info ./grpcio-*.dist-info ./PyYAML-*.dist-info ./pyyaml-*.dist-info ./typing_extensions.py \
  ./six.py ./ray/jars ./ray/dashboard/client/build ./bin
find . -name __pycache__ -type d -prune -exec rm -rf {} +
cd - > /dev/null
mkdir -p "$OUT_DIR"
ARCHIVE="$OUT_DIR/ray-serve-$VERSION-cp312.tar.xz"
tar cf - -C "$WORK/site" . | xz -T0 -6 > "$ARCHIVE"
du -h "$ARCHIVE"
