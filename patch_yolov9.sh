#!/usr/bin/env bash
# Install the yolov9-qat overlay into a YOLOv9 tree, check it, or remove it again.
#
# The overlay is this repository's top-level *.py CLIs and everything under models/, utils/,
# scripts/ and segment/. What was installed is recorded in YOLOV9_DIR/.yolov9-qat-manifest
# (one line per file: path, sha256, toolkit version; one line per directory the overlay created:
# path/, "-", version), so that a re-run touches only the toolkit's own files and --uninstall
# removes exactly those. Upstream files are never overwritten or deleted. Installed from a git
# clone, the version names its commit: 0.1.0+g<commit> (.dirty: overlay files had uncommitted
# changes), which utils/qat/core/provenance.py reads to record in every report and checkpoint.
set -euo pipefail

readonly MANIFEST_NAME=.yolov9-qat-manifest
readonly MANIFEST_HEADER=$'# yolov9-qat manifest: files patch_yolov9.sh installed (path\tsha256\tversion); do not edit'
readonly OVERLAY_DIRS=(models utils scripts segment)
readonly UPSTREAM_MARKERS=(models/yolo.py models/common.py models/experimental.py utils/general.py val.py)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
readonly REPO
PROG=${0##*/}

usage() {
    cat <<EOF
usage: $PROG [--force] YOLOV9_DIR
       $PROG --check YOLOV9_DIR
       $PROG --uninstall [--force] YOLOV9_DIR

Copies the yolov9-qat overlay (the top-level CLIs and models/, utils/, scripts/, segment/ of
$REPO) into the YOLOv9 tree YOLOV9_DIR and records what it installed in
YOLOV9_DIR/$MANIFEST_NAME. Upstream files are never overwritten or deleted: if an overlay
path already exists and was not installed by this script, nothing is changed.

Running it again updates the toolkit's files to this version and removes files the toolkit no
longer ships; a second run changes nothing. Files you edited after they were installed are
reported and kept.

options:
  --check      report each overlay file as installed, missing, modified (edited since it was
               installed), outdated (an older version of the toolkit), unmanaged (exists but was
               not installed by this script) or obsolete (no longer part of the toolkit);
               exit 0 only if every file is installed and current
  --uninstall  remove exactly the files the manifest lists, the directories the overlay
               created (once empty) and the manifest
  --force      overwrite (or, with --uninstall, remove) files you edited after they were installed
  -h, --help   show this help

exit status: 0 done, 1 a problem (one 'error: ...' sentence on stderr) or --check found the
tree not current, 2 wrong usage.
EOF
}

die() {
    echo "error: $*" >&2
    exit 1
}

usage_error() {
    echo "error: $* (see $PROG --help)." >&2
    exit 2
}

# "a, b, c" from the arguments.
join() {
    local IFS=$'\x1f' text
    text="$*"
    printf '%s' "${text//$'\x1f'/, }"
}

# hash_into NAME ROOT REL...: NAME[REL]=sha256 of ROOT/REL, for the regular files among the RELs
# (one sha256sum for all of them).
hash_into() {
    local -n into=$1
    local root=$2 rel line files=()
    shift 2
    for rel in "$@"; do
        if [ -f "$root/$rel" ] && [ ! -L "$root/$rel" ]; then files+=("$rel"); fi
    done
    [ ${#files[@]} -gt 0 ] || return 0
    while IFS= read -r -d '' line; do
        into[${line:66}]=${line:0:64}
    done < <(cd "$root" && sha256sum --zero -- "${files[@]}")
    for rel in "${files[@]}"; do
        [ -n "${into[$rel]:-}" ] || die "cannot read $root/$rel."
    done
}

# TREE_SHA[REL] for the tree's regular files among the overlay's and the manifest's paths.
declare -A TREE_SHA=()
hash_tree() {
    hash_into TREE_SHA "$TREE" "${OV_FILES[@]}" "${M_FILES[@]}"
}

# Is $1 a relative path inside the overlay's part of a tree (a top-level *.py, or under an overlay dir)?
in_overlay_zone() {
    local p=$1 d
    case /$p/ in
        *//* | */./* | */../*) return 1 ;;
    esac
    case $p in
        */*) ;;
        *.py) return 0 ;;
        *) return 1 ;;
    esac
    for d in "${OVERLAY_DIRS[@]}"; do
        case $p in "$d"/?*) return 0 ;; esac
    done
    return 1
}

# ---------------------------------------------------------------------------------------------
# The tree

check_tree() {
    if [ ! -e "$TREE" ]; then
        die "$TREE does not exist: pass the path of a YOLOv9 clone (git clone https://github.com/WongKinYiu/yolov9)."
    fi
    [ -d "$TREE" ] || die "$TREE is not a directory: pass the path of a YOLOv9 clone."
    [ -r "$TREE" ] && [ -x "$TREE" ] || die "cannot read $TREE (permission denied)."
    local marker missing=()
    for marker in "${UPSTREAM_MARKERS[@]}"; do
        [ -f "$TREE/$marker" ] || missing+=("$marker")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        die "$TREE is not a YOLOv9 tree: it lacks $(join "${missing[@]}") (pass the path of a clone of https://github.com/WongKinYiu/yolov9)."
    fi
}

# The deepest existing directory on the way to $1 (an absolute path).
existing_dir() {
    local d=$1
    while [ ! -d "$d" ]; do d=$(dirname "$d"); done
    printf '%s' "$d"
}

# Fails with one sentence unless a file can be created in every directory given (relative to the
# tree). Creating a probe file is the only test that tells the truth for root, read-only mounts
# and immutable directories alike.
check_writable() {
    local rel dir probe
    local -A seen=()
    for rel in "$@"; do
        dir=$(existing_dir "$TREE/$rel")
        [ -z "${seen[$dir]:-}" ] || continue
        seen[$dir]=1
        if ! probe=$(mktemp "$dir/.yolov9-qat-probe.XXXXXX" 2>/dev/null); then
            die "cannot write to $dir (no write permission or a read-only file system); nothing was changed."
        fi
        rm -f -- "$probe"
    done
}

# ---------------------------------------------------------------------------------------------
# The overlay (this repository)

OV_FILES=()
declare -A OV_SHA=() OV_MODE=()
VERSION=
LABEL=

list_overlay() {
    cd "$REPO"
    find . -maxdepth 1 -type f -name '[!.]*.py' -print0
    local d
    for d in "${OVERLAY_DIRS[@]}"; do
        [ -d "$d" ] || continue
        find "$d" \( -name __pycache__ -o -name '.*' \) -prune -o -type f ! -name '*.py[co]' ! -name '*~' -print0
    done
}

# LABEL: the version the manifest records, VERSION+g<commit>[.dirty] when $REPO is the top of a git
# clone (not a copy inside some other repository), else VERSION.
source_label() {
    local top commit
    LABEL=$VERSION
    top=$(git -C "$REPO" rev-parse --show-toplevel 2>/dev/null) || return 0
    [ "$(cd "$top" 2>/dev/null && pwd -P)" = "$REPO" ] || return 0
    commit=$(git -C "$REPO" rev-parse --verify -q HEAD 2>/dev/null) || return 0
    LABEL=$VERSION+g$commit
    if [ -n "$(git -C "$REPO" status --porcelain -- "${OVERLAY_DIRS[@]}" ':(glob)*.py' 2>/dev/null)" ]; then
        LABEL=$LABEL.dirty
    fi
}

load_overlay() {
    VERSION=$(sed -n "s/^__version__ *= *[\"']\([^\"']*\)[\"'].*/\1/p" "$REPO/utils/qat/__init__.py" 2>/dev/null | head -n 1)
    [ -n "$VERSION" ] || die "cannot read the toolkit version from $REPO/utils/qat/__init__.py (is this a complete yolov9-qat checkout?)."
    source_label
    local f
    while IFS= read -r -d '' f; do
        f=${f#./}
        case $f in
            *$'\t'* | *$'\n'*) die "overlay file name '$f' contains a tab or a newline; rename it." ;;
        esac
        OV_FILES+=("$f")
        if [ -x "$REPO/$f" ]; then OV_MODE[$f]=755; else OV_MODE[$f]=644; fi
    done < <(list_overlay | LC_ALL=C sort -z)
    hash_into OV_SHA "$REPO" "${OV_FILES[@]}"
}

# ---------------------------------------------------------------------------------------------
# The manifest

HAVE_MANIFEST=0
M_FILES=()
M_DIRS=()
declare -A M_SHA=() M_VER=() M_HAS_DIR=()

damaged() {
    die "the manifest $TREE/$MANIFEST_NAME is damaged ($1); restore it, or delete it together with the files it listed, then patch again."
}

load_manifest() {
    local manifest=$TREE/$MANIFEST_NAME
    [ -e "$manifest" ] || [ -L "$manifest" ] || return 0
    [ -f "$manifest" ] && [ -r "$manifest" ] || damaged "it is not a readable file"
    HAVE_MANIFEST=1
    local re=$'^([^\t]+)\t([0-9a-f]{64}|-)\t([^\t]+)$'
    local n=0 line path sha ver
    while IFS= read -r line || [ -n "$line" ]; do
        n=$((n + 1))
        if [ $n -eq 1 ]; then
            [ "$line" = "$MANIFEST_HEADER" ] || damaged "line 1 is not the yolov9-qat header"
            continue
        fi
        [[ $line =~ $re ]] || damaged "line $n is not 'path<TAB>sha256<TAB>version'"
        path=${BASH_REMATCH[1]} sha=${BASH_REMATCH[2]} ver=${BASH_REMATCH[3]}
        if [ "$sha" = - ]; then
            [[ $path == */ ]] || damaged "line $n: a directory entry must end with /"
            # (a directory entry is valid where an overlay file could lie inside it)
            in_overlay_zone "${path}x" || damaged "line $n: $path is not a place the overlay installs to"
            [ -z "${M_HAS_DIR[$path]:-}" ] || damaged "line $n: $path is listed twice"
            M_HAS_DIR[$path]=1
            M_DIRS+=("$path")
        else
            [[ $path != */ ]] || damaged "line $n: a file entry must not end with /"
            in_overlay_zone "$path" || damaged "line $n: $path is not a place the overlay installs to"
            [ -z "${M_SHA[$path]:-}" ] || damaged "line $n: $path is listed twice"
            M_SHA[$path]=$sha
            M_VER[$path]=$ver
            M_FILES+=("$path")
        fi
    done <"$manifest"
    [ $n -ge 1 ] || damaged "it is empty"
}

write_manifest() { # $@: entry lines; rewrites the manifest only if its content changes
    local manifest=$TREE/$MANIFEST_NAME content tmp
    content=$(printf '%s\n' "$MANIFEST_HEADER"; printf '%s\n' "$@" | LC_ALL=C sort)
    if [ -f "$manifest" ] && [ "$(cat "$manifest")" = "$content" ]; then
        return 0
    fi
    tmp=$(mktemp "$TREE/.$MANIFEST_NAME.XXXXXX") || die "cannot write the manifest in $TREE."
    if ! printf '%s\n' "$content" >"$tmp" || ! chmod 644 "$tmp" || ! mv -f -- "$tmp" "$manifest"; then
        rm -f -- "$tmp"
        die "cannot write the manifest $manifest."
    fi
}

# ---------------------------------------------------------------------------------------------
# Removing files and the directories the overlay created

# Removes $1 (relative) and, for a .py file, its bytecode in __pycache__ (and that folder once empty).
remove_file() {
    local rel=$1 dir base
    rm -f -- "$TREE/$rel"
    if [[ $rel == *.py ]]; then
        dir=$(dirname "$TREE/$rel")
        base=$(basename "$rel" .py)
        rm -f -- "$dir/__pycache__/$base".*.pyc
        rmdir -- "$dir/__pycache__" 2>/dev/null || true
    fi
}

# Removes the created directories ($@, relative, ending in /) that are empty; prints those kept.
remove_empty_dirs() {
    local d
    while IFS= read -r d; do
        [ -n "$d" ] || continue
        [ -d "$TREE/$d" ] || continue
        rmdir -- "$TREE/$d" 2>/dev/null || echo "$d"
    done < <(printf '%s\n' "$@" | LC_ALL=C sort -r)
}

# ---------------------------------------------------------------------------------------------
# install

STAGE_TMP=()
STAGE_DEST=()
CREATED_NOW=()

rollback() {
    local i
    rm -f -- "${STAGE_TMP[@]}"
    for ((i = ${#CREATED_NOW[@]} - 1; i >= 0; i--)); do
        rmdir -- "$TREE/${CREATED_NOW[i]}" 2>/dev/null || true
    done
}

# Makes the missing directories on the way to $1 (a relative file path), recording them.
make_parents() {
    local rest=$1 path=
    while [[ $rest == */* ]]; do
        path=${path:+$path/}${rest%%/*}
        rest=${rest#*/}
        if [ ! -d "$TREE/$path" ]; then
            mkdir -- "$TREE/$path" || return 1
            CREATED_NOW+=("$path/")
        fi
    done
}

# Succeeds, setting BLOCKER, if a directory on the way to $1 (a relative file path) exists as
# something else.
BLOCKER=
blocking_ancestor() {
    local rest=$1 path=
    while [[ $rest == */* ]]; do
        path=${path:+$path/}${rest%%/*}
        rest=${rest#*/}
        if [ -e "$TREE/$path" ] && [ ! -d "$TREE/$path" ]; then
            BLOCKER=$path
            return 0
        fi
    done
    return 1
}

# "X already exists there and was" / "X, Y already exist there and were", for messages.
already_exist() {
    if [ $# -eq 1 ]; then
        printf '%s already exists there and was' "$1"
    else
        printf '%s already exist there and were' "$(join "$@")"
    fi
}

# Copies the overlay file $1 to a temporary file beside its destination.
stage() {
    local rel=$1 tmp
    make_parents "$rel" || return 1
    tmp=$(mktemp "$(dirname "$TREE/$rel")/.$(basename "$rel").yolov9-qat.XXXXXX") || return 1
    STAGE_TMP+=("$tmp")
    STAGE_DEST+=("$TREE/$rel")
    cp -- "$REPO/$rel" "$tmp" && chmod "${OV_MODE[$rel]}" "$tmp"
}

do_install() {
    local f t cur
    local -A action=()
    local collisions=() conflicts=() drop_rm=() drop_keep=() writes=() lines=()
    local n_new=0 n_upd=0

    for f in "${OV_FILES[@]}"; do
        t=$TREE/$f
        if blocking_ancestor "$f"; then
            collisions+=("$BLOCKER (a file where the overlay needs a directory)")
        elif [ -L "$t" ] || { [ -e "$t" ] && [ ! -f "$t" ]; }; then
            collisions+=("$f (not a regular file)")
        elif [ ! -e "$t" ]; then
            action[$f]=new
        elif [ -z "${M_SHA[$f]:-}" ]; then
            collisions+=("$f")
        else
            cur=${TREE_SHA[$f]}
            if [ "$cur" = "${OV_SHA[$f]}" ]; then
                action[$f]=same
            elif [ "$cur" = "${M_SHA[$f]}" ]; then
                action[$f]=update
            elif [ $FORCE -eq 1 ]; then
                action[$f]=overwrite
            elif [ "${M_SHA[$f]}" = "${OV_SHA[$f]}" ]; then
                action[$f]=keep  # edited by the user; the toolkit has not changed it since
            else
                conflicts+=("$f")
            fi
        fi
    done

    if [ ${#collisions[@]} -gt 0 ]; then
        die "refusing to patch $TREE: $(already_exist "${collisions[@]}") not installed by yolov9-qat (upstream files and your own are never overwritten); nothing was changed."
    fi
    if [ ${#conflicts[@]} -gt 0 ]; then
        die "refusing to patch $TREE: you edited $(join "${conflicts[@]}") after it was installed and this version of the toolkit changes it too; nothing was changed (save your edits elsewhere and rerun with --force to overwrite them)."
    fi

    # Files the toolkit no longer ships.
    for f in "${M_FILES[@]}"; do
        [ -z "${OV_SHA[$f]:-}" ] || continue
        t=$TREE/$f
        if [ ! -e "$t" ] && [ ! -L "$t" ]; then
            continue
        elif [ "${TREE_SHA[$f]:-}" = "${M_SHA[$f]}" ]; then
            drop_rm+=("$f")
        elif [ $FORCE -eq 1 ] && { [ -f "$t" ] || [ -L "$t" ]; }; then
            drop_rm+=("$f")
        else
            drop_keep+=("$f")
        fi
    done

    for f in "${OV_FILES[@]}"; do
        case ${action[$f]} in new | update | overwrite) writes+=("$f") ;; esac
    done
    check_writable . "${writes[@]}" "${drop_rm[@]}"

    # Stage every new file first; any failure undoes the staging and leaves the tree as it was.
    trap rollback EXIT
    for f in "${writes[@]}"; do
        stage "$f" || { rollback; trap - EXIT; die "cannot write $TREE/$f; nothing was changed."; }
    done
    trap - EXIT

    # Commit: renames only.
    local i
    for i in "${!STAGE_TMP[@]}"; do
        mv -f -- "${STAGE_TMP[i]}" "${STAGE_DEST[i]}"
    done
    for f in "${writes[@]}"; do
        case ${action[$f]} in
            new) n_new=$((n_new + 1)); echo "new       $f" ;;
            update) n_upd=$((n_upd + 1)); echo "updated   $f" ;;
            overwrite) n_upd=$((n_upd + 1)); echo "replaced  $f (your edits were overwritten: --force)" ;;
        esac
    done
    for f in "${OV_FILES[@]}"; do
        [ "${action[$f]}" != keep ] || echo "kept      $f (you edited it; --force restores the toolkit's version)"
    done
    for f in "${drop_rm[@]}"; do
        remove_file "$f"
        echo "removed   $f (no longer part of the toolkit)"
    done
    for f in "${drop_keep[@]}"; do
        echo "kept      $f (no longer part of the toolkit, but you edited it: it is yours now)"
    done

    # Directories the overlay created: those recorded before and those made now, while they exist.
    local dirs=() d
    for d in "${M_DIRS[@]}" "${CREATED_NOW[@]}"; do
        dirs+=("$d")
    done
    if [ ${#drop_rm[@]} -gt 0 ]; then
        # Drop the created directories that no overlay file needs any more, when empty.
        local needed=()
        for d in "${dirs[@]}"; do
            local used=0
            for f in "${OV_FILES[@]}"; do
                [[ $f != "$d"* ]] || { used=1; break; }
            done
            [ $used -eq 1 ] || needed+=("$d")
        done
        [ ${#needed[@]} -eq 0 ] || remove_empty_dirs "${needed[@]}" >/dev/null
    fi

    for f in "${OV_FILES[@]}"; do
        if [ "${action[$f]}" = keep ]; then
            lines+=("$f"$'\t'"${M_SHA[$f]}"$'\t'"${M_VER[$f]}")
        else
            lines+=("$f"$'\t'"${OV_SHA[$f]}"$'\t'"$LABEL")
        fi
    done
    local -A dir_seen=()
    for d in "${dirs[@]}"; do
        [ -d "$TREE/$d" ] && [ -z "${dir_seen[$d]:-}" ] || continue
        dir_seen[$d]=1
        lines+=("$d"$'\t-\t'"$LABEL")
    done
    write_manifest "${lines[@]}"

    local total=${#OV_FILES[@]}
    if [ $n_new -eq 0 ] && [ $n_upd -eq 0 ] && [ ${#drop_rm[@]} -eq 0 ]; then
        echo "yolov9-qat $VERSION is up to date in $TREE ($total files)."
    else
        echo "yolov9-qat $VERSION installed in $TREE: $n_new new, $n_upd updated, ${#drop_rm[@]} removed, $total files in all."
    fi
}

# ---------------------------------------------------------------------------------------------
# --check

do_check() {
    local f t cur status
    local -A count=()
    local order=(installed missing modified outdated unmanaged obsolete)
    for f in "${OV_FILES[@]}"; do
        t=$TREE/$f
        if [ -z "${M_SHA[$f]:-}" ]; then
            if [ -e "$t" ] || [ -L "$t" ]; then status=unmanaged; else status=missing; fi
        elif [ ! -f "$t" ]; then
            status=missing
        else
            cur=${TREE_SHA[$f]:-}
            if [ "$cur" != "${M_SHA[$f]}" ]; then
                status=modified
            elif [ "$cur" != "${OV_SHA[$f]}" ]; then
                status=outdated
            else
                status=installed
            fi
        fi
        count[$status]=$((${count[$status]:-0} + 1))
        printf '%-10s %s\n' "$status" "$f"
    done
    for f in "${M_FILES[@]}"; do
        [ -z "${OV_SHA[$f]:-}" ] || continue
        [ -e "$TREE/$f" ] || [ -L "$TREE/$f" ] || continue
        count[obsolete]=$((${count[obsolete]:-0} + 1))
        printf '%-10s %s\n' obsolete "$f"
    done
    local summary=()
    for status in "${order[@]}"; do
        [ -z "${count[$status]:-}" ] || summary+=("${count[$status]} $status")
    done
    if [ $HAVE_MANIFEST -eq 0 ]; then
        echo "yolov9-qat is not installed in $TREE ($(join "${summary[@]}")): run $PROG $TREE."
        return 1
    fi
    if [ ${#summary[@]} -eq 1 ] && [ -n "${count[installed]:-}" ]; then
        echo "yolov9-qat $VERSION is installed and current in $TREE (${count[installed]} files)."
        return 0
    fi
    echo "yolov9-qat in $TREE is not current ($(join "${summary[@]}")): run $PROG $TREE (with --force to overwrite modified files)."
    return 1
}

# ---------------------------------------------------------------------------------------------
# --uninstall

do_uninstall() {
    if [ $HAVE_MANIFEST -eq 0 ]; then
        echo "nothing to uninstall: $TREE has no $MANIFEST_NAME (yolov9-qat is not installed there)."
        return 0
    fi
    local f t edited=() remove=() kept_files=()
    for f in "${M_FILES[@]}"; do
        t=$TREE/$f
        if [ ! -e "$t" ] && [ ! -L "$t" ]; then
            continue
        elif [ "${TREE_SHA[$f]:-}" = "${M_SHA[$f]}" ]; then
            remove+=("$f")
        elif [ -d "$t" ] && [ ! -L "$t" ]; then
            kept_files+=("$f")  # replaced by a directory: never removed
        else
            edited+=("$f")
        fi
    done
    if [ ${#edited[@]} -gt 0 ] && [ $FORCE -eq 0 ]; then
        die "refusing to uninstall from $TREE: you edited $(join "${edited[@]}") after it was installed; nothing was changed (save your edits elsewhere and rerun with --force to remove them)."
    fi
    remove+=("${edited[@]}")
    check_writable . "${remove[@]}"

    for f in "${remove[@]}"; do
        remove_file "$f"
        echo "removed   $f"
    done
    for f in "${kept_files[@]}"; do
        echo "kept      $f (a directory now, not the file yolov9-qat installed)"
    done
    local d
    if [ ${#M_DIRS[@]} -gt 0 ]; then
        while IFS= read -r d; do
            if [ -n "$d" ]; then echo "kept      $d (holds files yolov9-qat did not install)"; fi
        done < <(remove_empty_dirs "${M_DIRS[@]}")
    fi
    rm -f -- "$TREE/$MANIFEST_NAME"
    echo "yolov9-qat uninstalled from $TREE (${#remove[@]} files removed)."
}

# ---------------------------------------------------------------------------------------------

main() {
    local mode=install arg
    FORCE=0
    TREE=
    while [ $# -gt 0 ]; do
        arg=$1
        shift
        case $arg in
            -h | --help) usage; exit 0 ;;
            --check | --uninstall)
                [ $mode = install ] || [ $mode = "${arg#--}" ] || usage_error "--check and --uninstall cannot be combined"
                mode=${arg#--}
                ;;
            -f | --force) FORCE=1 ;;
            --) [ $# -gt 0 ] || break; arg=$1; shift
                [ -z "$TREE" ] || usage_error "expected one YOLOV9_DIR, got '$TREE' and '$arg'"
                TREE=$arg ;;
            -*) usage_error "unknown option $arg" ;;
            *)
                [ -z "$TREE" ] || usage_error "expected one YOLOV9_DIR, got '$TREE' and '$arg'"
                TREE=$arg
                ;;
        esac
    done
    [ -n "$TREE" ] || usage_error "missing YOLOV9_DIR, the YOLOv9 tree to patch"
    [ "$TREE" = / ] || TREE=${TREE%/}

    check_tree
    load_manifest
    case $mode in
        install) load_overlay; hash_tree; do_install ;;
        check) load_overlay; hash_tree; do_check ;;
        uninstall) hash_tree; do_uninstall ;;
    esac
}

main "$@"
