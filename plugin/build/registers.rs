//! Register counts of CUDA functions, read from a relocatable cubin's `.nv.info` (EIATTR_REGCOUNT), and
//! the cap check. Used by plugin/build.rs (the build fails on a violation) and by the plugin's tests.

const EIATTR_REGCOUNT: u8 = 0x2f;

/// Checks hook functions (`ncclscope_hook*`, `ncclscope_ref_*`) against `cap` when given; without a cap,
/// checks that harness kernels (`ncclscope_harness*`) allocate at least `hook_regs` (a callee using more
/// registers than its caller allocated faults).
pub fn check(counts: &[(String, u32)], cap: Option<usize>, hook_regs: usize) -> Result<(), String> {
    let mut seen_hook = false;
    for (func, regs) in counts {
        let regs = *regs as usize;
        match cap {
            Some(cap)
                if func.starts_with("ncclscope_hook") || func.starts_with("ncclscope_ref_") =>
            {
                seen_hook |= func == "ncclscope_hook";
                if regs > cap {
                    return Err(format!(
                        "{func} uses {regs} registers, over the cap of {cap}"
                    ));
                }
            }
            None if func.starts_with("ncclscope_harness") && regs < hook_regs => {
                return Err(format!(
                    "kernel {func} allocates {regs} registers, fewer than the hook's {hook_regs}"
                ));
            }
            _ => {}
        }
    }
    if cap.is_some() && !seen_hook {
        return Err(format!(
            "no register count recorded for ncclscope_hook: {counts:?}"
        ));
    }
    Ok(())
}

/// (function name, registers) from a CUDA ELF's .nv.info section. Records are
/// {format u8, attribute u8, size u16, payload}; REGCOUNT's payload is {symbol index u32, count u32}.
pub fn register_counts(elf: &[u8]) -> Option<Vec<(String, u32)>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(0x28)? as usize,
        u16_at(0x3a)? as usize,
        u16_at(0x3c)? as usize,
        u16_at(0x3e)? as usize,
    );
    let section = |i: usize| {
        let h = shoff + i * shentsize;
        Some((
            u32_at(h)?,
            u32_at(h + 4)?,
            u64_at(h + 0x18)? as usize,
            u64_at(h + 0x20)? as usize,
            u32_at(h + 0x28)?,
        ))
    };
    let cstr = |o: usize| {
        let bytes = elf.get(o..)?;
        let end = bytes.iter().position(|&b| b == 0)?;
        Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
    };
    let (_, _, names, _, _) = section(shstrndx)?;
    let (mut info, mut symtab) = (None, None);
    for i in 0..shnum {
        let (name, kind, off, size, link) = section(i)?;
        match cstr(names + name as usize)?.as_str() {
            ".nv.info" => info = Some((off, size)),
            _ if kind == 2 => symtab = Some((off, size, link)),
            _ => {}
        }
    }
    let ((info_off, info_size), (sym_off, _, strtab)) = (info?, symtab?);
    let (_, _, str_off, _, _) = section(strtab as usize)?;
    let mut counts = Vec::new();
    let mut o = info_off;
    while o + 4 <= info_off + info_size {
        let (attr, size) = (elf[o + 1], u16_at(o + 2)? as usize);
        if elf[o] == 0x04 && attr == EIATTR_REGCOUNT {
            let (sym, regs) = (u32_at(o + 4)? as usize, u32_at(o + 8)?);
            let name = cstr(str_off + u32_at(sym_off + sym * 24)? as usize)?;
            counts.push((name, regs));
        }
        o += 4 + if elf[o] == 0x04 { size } else { 0 };
    }
    Some(counts)
}
