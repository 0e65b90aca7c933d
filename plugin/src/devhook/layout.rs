// The ring layout shared by the CUDA hook (cuda/) and the drain: its ONE source. plugin/build.rs
// `include!`s this file and passes every constant to nvcc as `-DNCCLSCOPE_<NAME>=<value>`, so the device
// code and the Rust reader cannot disagree.
//
// A communicator's ring block holds `MAX_CHANNELS` rings back to back, each of `2^shift` slots of
// `SLOT_BYTES`. A slot holds one RFC event as `SLOT_WORDS` 8-byte words: low half = one 4-byte word of the
// event, high half = the slot's flag (low 32 bits of its sequence + 1). The sequence of an event is
// `workCounter * 2 + phase`. devCtx is the block's address with `shift` in its low bits (the block is
// aligned to `BLOCK_ALIGN`), so the hook reads no memory but the event.

macro_rules! layout {
    ($($(#[$doc:meta])* $name:ident: $ty:ty = $value:expr;)*) => {
        $($(#[$doc])* pub const $name: $ty = $value;)*
        /// Every constant above as (name, value): the `-D` defines the build script hands to nvcc.
        #[allow(dead_code)]
        pub const DEFINES: &[(&str, u64)] = &[$((stringify!($name), $name as u64)),*];
    };
}

layout! {
    /// Rings per communicator: NCCL's MAXCHANNELS. The hook masks the event's channel with it.
    MAX_CHANNELS: usize = 64;
    /// Size of the RFC's `ncclProfilerDevEvent_t`.
    EVENT_BYTES: usize = 24;
    /// 8-byte {payload, flag} words per slot: one per 4-byte word of the event.
    SLOT_WORDS: usize = 6;
    /// Bytes per slot.
    SLOT_BYTES: usize = 48;
    /// Low bits of devCtx that carry log2(slots per ring).
    CTX_SHIFT_MASK: usize = 63;
    /// Alignment of a ring block (keeps devCtx's low bits free, and slots 16-byte aligned).
    BLOCK_ALIGN: usize = 4096;
    /// Register cap of the hook: it must fit in every NCCL kernel's allocation (96 on sm_90).
    HOOK_MAX_REGS: usize = 32;
}

const _: () = assert!(SLOT_BYTES == SLOT_WORDS * 8 && SLOT_WORDS * 4 == EVENT_BYTES);
const _: () = assert!(BLOCK_ALIGN > CTX_SHIFT_MASK && MAX_CHANNELS.is_power_of_two());
