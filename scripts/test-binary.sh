# Sourced by the scripts that run test binaries outside cargo (gpu-bundle.sh).
#
# test_binary PKG TARGET [CARGO_TEST_FLAGS...]
#   Builds (if needed) integration test TARGET of package PKG and prints "EXECUTABLE PACKAGE_DIR"
#   (the package's folder is where cargo runs that binary); prints nothing if it did not build.
test_binary() {
  local pkg=$1 target=$2
  shift 2
  cargo test -q "$@" -p "$pkg" --test "$target" --no-run --message-format=json 2>/dev/null |
    python3 -c "
import json, os, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == sys.argv[1]:
        print(m['executable'], os.path.dirname(m['manifest_path']))" "$target"
}
