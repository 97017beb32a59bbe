#!/bin/sh
# check_include_order.sh - the layer rule of design.md §3 as a test.
#
# Usage: check_include_order.sh SRC_DIR
#
# The modules under src/ form one order,
#   core < tensor < gguf < kv < tokenizer < model < sample < chat < apc < engine < serve < cli,
# and a file may include headers of its own module or of lower ones only. This
# scans every src/<module>/*.c and *.h for `#include "<module>/..."` and
# prints each include that runs up the order as FILE:LINE; the exit status is
# 1 when there is one, 0 otherwise. A directory under src/ that is not in the
# order is an error too, so a new module has to be placed before it is used.
set -u
src=${1:?usage: check_include_order.sh SRC_DIR}
order="core tensor gguf kv tokenizer model sample chat apc engine serve cli"

rank() {
    i=0
    for m in $order; do
        [ "$m" = "$1" ] && { echo $i; return; }
        i=$((i + 1))
    done
    echo -1
}

bad=0
for dir in "$src"/*/; do
    mod=$(basename "$dir")
    r=$(rank "$mod")
    if [ "$r" -lt 0 ]; then
        echo "src/$mod/: module not in the layer order ($order); add it to design.md and to this test"
        bad=1
        continue
    fi
    for f in "$dir"*.c "$dir"*.h; do
        [ -f "$f" ] || continue
        # A relative include ("../x/y.h") would hide the module it reaches.
        rel=$(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\.\./' "$f" | cut -d: -f1)
        for line in $rel; do
            echo "src/$mod/$(basename "$f"):$line: relative include; name the module (\"module/file.h\")"
            bad=1
        done
        # LINE:MODULE for every quoted include of the form "module/...".
        hits=$(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[a-z_0-9]*/' "$f" |
               sed 's/^\([0-9]*\):[^"]*"\([a-z_0-9]*\)\/.*/\1:\2/')
        for h in $hits; do
            line=${h%%:*}
            inc=${h#*:}
            ir=$(rank "$inc")
            if [ "$ir" -lt 0 ]; then
                echo "src/$mod/$(basename "$f"):$line: includes \"$inc/...\", which is not a module in the layer order"
                bad=1
            elif [ "$ir" -gt "$r" ]; then
                echo "src/$mod/$(basename "$f"):$line: $mod includes \"$inc/...\" but $inc is above $mod in the layer order ($order)"
                bad=1
            fi
        done
    done
done
[ $bad -eq 0 ] && echo "include order: every include in $src runs down the layer order"
exit $bad
