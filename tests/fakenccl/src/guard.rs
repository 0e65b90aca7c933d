//! Buffers that end flush against an unmapped page: a plugin that reads one byte past the descriptor
//! version it was given faults instead of silently reading garbage.

use std::ffi::c_void;

/// One readable/writable page followed by a PROT_NONE page; objects are placed at the end of the first.
pub struct GuardedPage {
    base: *mut u8,
    page: usize,
}

// SAFETY: the mapping is owned by this value and only accessed through `&mut self` or by the callee of
// a call made with `&mut self`.
unsafe impl Send for GuardedPage {}

impl GuardedPage {
    pub fn new() -> std::io::Result<GuardedPage> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: an anonymous private mapping of two pages; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the second page of the mapping just created.
        if unsafe { libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE) } != 0
        {
            let e = std::io::Error::last_os_error();
            // SAFETY: our own mapping.
            unsafe { libc::munmap(base, 2 * page) };
            return Err(e);
        }
        Ok(GuardedPage {
            base: base.cast(),
            page,
        })
    }

    /// A zeroed `len`-byte buffer whose last byte is the last readable byte before the guard page.
    pub fn flush_end(&mut self, len: usize) -> *mut u8 {
        assert!(
            len <= self.page && len.is_multiple_of(8),
            "guarded object of {len} bytes"
        );
        // SAFETY: `len` bytes at the end of the first (writable) page.
        unsafe {
            let p = self.base.add(self.page - len);
            std::ptr::write_bytes(p, 0, len);
            p
        }
    }
}

impl Drop for GuardedPage {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(self.base.cast::<c_void>(), 2 * self.page) };
    }
}
