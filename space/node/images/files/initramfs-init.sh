#!/bin/sh
# PID 1 of SPACE's guest initramfs (busybox): load the virtio modules, mount the ext4
# root from /dev/vda read-write and hand over to /usr/lib/space/init. On any failure it
# says why on the console and powers off: a guest must never hang in its initramfs.
# The builder replaces the module list below; lines are kept short for busybox sh.
export PATH=/bin
MODULES="@MODULES@"
ROOT_DEVICE=/dev/vda
ROOT_WAIT_TICKS=1000   # x 10 ms: 10 s, generous for TCG
NEXT_INIT=/usr/lib/space/init

fail() {
    echo "space-initramfs: FATAL: $*" >/dev/console
    sleep 1
    poweroff -f
    # poweroff never returns; if it did, PID 1 exiting panics the kernel (panic=-1).
    exit 1
}

mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sysfs /sys || fail "cannot mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "cannot mount /dev"

for module in $MODULES; do
    insmod "/lib/modules/$module.ko" || fail "cannot load kernel module $module"
done

ticks=0
while [ ! -b "$ROOT_DEVICE" ]; do
    ticks=$((ticks + 1))
    [ "$ticks" -le "$ROOT_WAIT_TICKS" ] || fail "root disk $ROOT_DEVICE did not appear"
    usleep 10000
done

mount -t ext4 -o rw "$ROOT_DEVICE" /newroot || fail "cannot mount $ROOT_DEVICE (ext4)"
[ -x "/newroot$NEXT_INIT" ] || fail "$NEXT_INIT is missing on the root disk"

# Hand the mounted pseudo filesystems over so the next init finds them in place.
for fs in dev proc sys; do
    mount --move "/$fs" "/newroot/$fs" || fail "cannot move /$fs into the root disk"
done
echo "space-initramfs: switching to $NEXT_INIT" >/dev/console
exec switch_root /newroot "$NEXT_INIT" "$@" || fail "switch_root failed"
