# Source at the start of a command on a lent GPU machine that lacks longtrain's pure-Python needs (datasets,
# pydantic): `. benchmarks/device_setup.sh && python benchmarks/books_study.py --train /tmp/books/gutenberg/train ...`.
# Installs the wheels carried in .whl/ into /tmp/site and unpacks a carried .dev/books.tar.xz (a tar of the
# gutenberg folder) into /tmp/books, once per machine (a warm machine keeps both between calls), and puts the repo
# and /tmp/site on PYTHONPATH. Making the carried files, on the development machine (the repo's root):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl datasets pydantic pydantic_core \
#     annotated-types typing-inspection dill multiprocess xxhash          # + fla-core einops for longtrain[linear]
#   mkdir -p .dev && tar -C ../shared/data -cf - gutenberg | xz -6 -T2 > .dev/books.tar.xz
# (.whl/ and .dev/ ignored by git; name both in the call's carry.)
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed || { echo "device_setup: the wheels in .whl did not install" >&2; return 9; }
fi
# unpacked beside, then moved into place: an archive cut short (still being written when the call was made) must not
# leave a partial /tmp/books that a later call would take for the whole corpus
if [ -f .dev/books.tar.xz ] && [ ! -f /tmp/books/.unpacked ]; then
  rm -rf /tmp/books /tmp/books.part && mkdir -p /tmp/books.part && tar -xJf .dev/books.tar.xz -C /tmp/books.part \
    && touch /tmp/books.part/.unpacked && mv /tmp/books.part /tmp/books \
    || { rm -rf /tmp/books.part; echo "device_setup: books did not unpack (the archive is cut short or damaged)" >&2; return 8; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import datasets, pydantic" || { echo "device_setup: datasets or pydantic missing (carry .whl)" >&2; return 7; }
# Which files these are: the copy's git HEAD can be stale (it read c15e825 for 62352b8's files on 2026-12-04), so the
# tree id of the files themselves (a scratch index: the copy's own is left alone), which names a commit here with
# `git log --format='%h %t' | grep <id>` (no commit: uncommitted changes were carried). Benchmarks record
# LONGTRAIN_COMMIT; unset, it becomes this id.
LONGTRAIN_TREE=$(GIT_INDEX_FILE=/tmp/longtrain-tree.index git add -A . 2>/dev/null \
  && GIT_INDEX_FILE=/tmp/longtrain-tree.index git write-tree 2>/dev/null | cut -c1-7)
export LONGTRAIN_TREE LONGTRAIN_COMMIT="${LONGTRAIN_COMMIT:-${LONGTRAIN_TREE:+tree $LONGTRAIN_TREE}}"
echo "device_setup: files of tree ${LONGTRAIN_TREE:-unknown} (git HEAD here: $(git rev-parse --short HEAD 2>/dev/null)), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
