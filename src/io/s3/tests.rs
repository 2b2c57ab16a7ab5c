use super::download::FetchState;
use super::*;

#[test]
fn urls() {
    let u = ObjectUrl::parse(Path::new("s3://b/dir/x.czr")).unwrap();
    assert_eq!((u.bucket.as_str(), u.key.as_str()), ("b", "dir/x.czr"));
    assert_eq!(u.to_string(), "s3://b/dir/x.czr");
    for bad in ["s3://b", "s3://b/", "s3:///k", "s3://b/a//c", "s3://b/../k", "s3://b/d/"] {
        assert!(ObjectUrl::parse(Path::new(bad)).is_err(), "{bad}");
    }
    assert!(is_url(Path::new("s3://b/k")) && !is_url(Path::new("./s3:/b/k")));
}

#[test]
fn parts_cover_the_limit() {
    let total: u64 = (0..10_000).map(|n| part_size(n) as u64).sum();
    assert!(total > 4 << 40, "10,000 parts cover {total} bytes");
    assert!(part_size(9_999) <= 5 << 30, "S3's largest part is 5 GiB");
}

#[test]
fn chunks_come_tail_first_then_as_wanted_then_in_order() {
    let mut s =
        FetchState { started: vec![false; 6], done: vec![false; 6], wanted: VecDeque::new(), next: 0, failed: None };
    s.wanted.extend([3, 0]);
    let order: Vec<usize> = std::iter::from_fn(|| s.pick()).collect();
    assert_eq!(order, [5, 3, 0, 1, 2, 4]);
    let mut empty = FetchState { started: vec![], done: vec![], wanted: VecDeque::new(), next: 0, failed: None };
    assert_eq!(empty.pick(), None);
}
