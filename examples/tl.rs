fn main() {
    let mut cfg = shoal::config::RunConfig::tiny();
    let args: Vec<String> = std::env::args().collect();
    if let Some(c) = args.get(2) { cfg.codecs.activations = c.parse().unwrap(); }
    let steps: u64 = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(300);
    let r = shoal::train::train_local(&cfg, &shoal::train::LocalOptions { steps: Some(steps), ..Default::default() }, &mut |p| if p.step % 50 == 0 || p.step == 1 { println!("step {} loss {:.4} lr {:.2e} tok/s {:.0}", p.step, p.loss, p.lr, p.tokens_per_s) }).unwrap();
    println!("eval {:.4} entropy {:?} best {:?} secs {:.1} ratio {:.2}", r.eval_loss, r.entropy_rate, r.best_loss, r.seconds, r.compression_ratio());
}
