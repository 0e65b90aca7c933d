#[test]
fn dbg() {
    let seg = ncclscope_fakenccl::process::read_only_segment("dbgw").unwrap();
    let mut a = ncclscope::assemble::Assembler::new(1, "j".into(), "h".into(), 100000);
    let mut out = Vec::new();
    let mut worst = (0u64, 0u64);
    for (i, r) in seg.records.iter().enumerate() {
        a.apply(i as u64, r, 0, &mut out);
        if let Some(p) = a.oldest_pending_pos() {
            if i as u64 - p > worst.0 {
                worst = (i as u64 - p, p);
            }
        }
    }
    eprintln!(
        "records {} out {} worst lag {:?} pending {} {:?}",
        seg.records.len(),
        out.len(),
        worst,
        a.pending(),
        a.counters
    );
    eprintln!("at worst: {:?}", &seg.records[worst.1 as usize]);
}
