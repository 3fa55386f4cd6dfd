fn main() {
    let rows = shoal::bench::codec::run(&Default::default()).unwrap();
    print!("{}", shoal::bench::codec::table(&rows));
}
