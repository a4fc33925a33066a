//! One test per rule of the queue.

use super::*;

fn class(name: &str, weight: u64) -> PolicyClass {
    PolicyClass {
        name: name.to_owned(),
        weight,
        max_queued: None,
    }
}

fn queue(weights: &[u64], order: QueueOrder) -> DrrQueue<&'static str> {
    let classes = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| class(&format!("c{i}"), w))
        .collect();
    DrrQueue::new(classes, order).unwrap()
}

fn all(_: usize, _: &&str) -> bool {
    true
}

#[test]
fn new_validates_classes() {
    let err = DrrQueue::<()>::new(vec![], QueueOrder::Fcfs).unwrap_err();
    assert_eq!(err, QueueConfigError::NoClasses);
    let err = DrrQueue::<()>::new(vec![class("a", 1), class("b", 0)], QueueOrder::Fcfs);
    assert_eq!(
        err.unwrap_err(),
        QueueConfigError::ZeroWeight { class: "b".into() }
    );
    let err = DrrQueue::<()>::new(vec![class("a", 1), class("a", 2)], QueueOrder::Fcfs);
    assert_eq!(
        err.unwrap_err(),
        QueueConfigError::DuplicateClass { class: "a".into() }
    );
    let q = queue(&[1, 2], QueueOrder::Wspt);
    assert_eq!(q.class_index("c1"), Some(1));
    assert_eq!(q.class_index("nope"), None);
    assert_eq!(q.classes()[1].weight, 2);
    assert_eq!(q.order(), QueueOrder::Wspt);
}

#[test]
fn fcfs_keeps_arrival_order() {
    let mut q = queue(&[1_000_000], QueueOrder::Fcfs);
    for (item, cost) in [("a", 30), ("b", 10), ("c", 20)] {
        q.push(0, item, cost).unwrap();
    }
    let order: Vec<_> = std::iter::from_fn(|| q.pop(all)).map(|(_, i)| i).collect();
    assert_eq!(order, ["a", "b", "c"]);
}

#[test]
fn wspt_takes_fewest_cost_first_then_arrival() {
    let mut q = queue(&[1_000_000], QueueOrder::Wspt);
    for (item, cost) in [("a", 30), ("b", 10), ("c", 20), ("d", 10)] {
        q.push(0, item, cost).unwrap();
    }
    let order: Vec<_> = std::iter::from_fn(|| q.pop(all)).map(|(_, i)| i).collect();
    assert_eq!(order, ["b", "d", "c", "a"]);
}

#[test]
fn full_class_refuses_and_unknown_class_errs() {
    let mut classes = vec![class("small", 1), class("big", 1)];
    classes[0].max_queued = Some(2);
    let mut q = DrrQueue::new(classes, QueueOrder::Fcfs).unwrap();
    q.push(0, "a", 1).unwrap();
    q.push(0, "b", 1).unwrap();
    assert_eq!(q.push(0, "c", 1), Err(QueueError::Full { class: 0 }));
    assert_eq!(
        q.push(2, "c", 1),
        Err(QueueError::UnknownClass { class: 2 })
    );
    q.push(1, "c", 1).unwrap();
    assert_eq!((q.len(), q.class_len(0), q.class_len(1)), (3, 2, 1));
    // Room again once one leaves.
    q.pop(|c, _| c == 0).unwrap();
    q.push(0, "d", 1).unwrap();
}

#[test]
fn remove_takes_the_item_once() {
    let mut q = queue(&[10], QueueOrder::Fcfs);
    let a = q.push(0, "a", 1).unwrap();
    let b = q.push(0, "b", 1).unwrap();
    assert_eq!(b.class(), 0);
    assert_eq!(q.remove(a), Some("a"));
    assert_eq!(q.remove(a), None);
    assert_eq!(q.len(), 1);
    assert_eq!(q.pop(all), Some((0, "b")));
    assert_eq!(q.remove(b), None);
    assert!(q.is_empty());
}

#[test]
fn empty_class_resets_its_deficit() {
    let mut q = queue(&[100], QueueOrder::Fcfs);
    q.push(0, "a", 10).unwrap();
    q.push(0, "b", 10).unwrap();
    assert_eq!(q.pop(all), Some((0, "a")));
    assert_eq!(q.deficit(0), 90);
    assert_eq!(q.pop(all), Some((0, "b")));
    assert_eq!(q.deficit(0), 0, "emptied by pop");
    // A new arrival starts from zero: one quantum, not the 80 left over.
    q.push(0, "c", 10).unwrap();
    q.push(0, "d", 10).unwrap();
    assert_eq!(q.pop(all), Some((0, "c")));
    assert_eq!(q.deficit(0), 90);
}

#[test]
fn emptied_by_remove_resets_deficit() {
    let mut q = queue(&[100], QueueOrder::Fcfs);
    q.push(0, "a", 10).unwrap();
    let b = q.push(0, "b", 10).unwrap();
    q.pop(all).unwrap();
    assert_eq!(q.deficit(0), 90);
    q.remove(b).unwrap();
    assert_eq!(q.deficit(0), 0);
}

#[test]
fn blocked_class_keeps_deficit_and_earns_nothing() {
    let mut q = queue(&[100, 100], QueueOrder::Fcfs);
    q.push(0, "a0", 30).unwrap();
    q.push(0, "a1", 30).unwrap();
    q.push(0, "a2", 30).unwrap();
    for i in 0..10 {
        q.push(1, if i % 2 == 0 { "b" } else { "B" }, 60).unwrap();
    }
    assert_eq!(q.pop(all), Some((0, "a0")));
    assert_eq!(q.deficit(0), 70);
    // Class 0 blocked: class 1 runs for many rounds; class 0 neither loses nor earns.
    for _ in 0..8 {
        assert_eq!(q.pop(|c, _| c == 1).unwrap().0, 1);
        assert_eq!(q.deficit(0), 70);
    }
    // Unblocked, it earns one quantum at its next visit, not the rounds it missed.
    let (c, _) = std::iter::from_fn(|| q.pop(all))
        .find(|(c, _)| *c == 0)
        .unwrap();
    assert_eq!(c, 0);
    assert_eq!(q.deficit(0), 70 + 100 - 30);
}

#[test]
fn oversized_head_is_dispatched_via_bulk_credit() {
    let mut q = queue(&[3, 5], QueueOrder::Fcfs);
    q.push(0, "huge", 1_000_000_000_000).unwrap();
    q.push(1, "small", 1).unwrap();
    // Class 1 blocked: class 0 gets all the rounds it needs in one step.
    assert_eq!(q.pop(|c, _| c == 0), Some((0, "huge")));
    assert_eq!(q.deficit(0), 0, "emptied");
    q.push(0, "big", 10).unwrap();
    q.push(0, "next", 1).unwrap();
    // Class 1 is the only other ready class; it is visited each round meanwhile:
    // class 0 needs 4 visits (12 >= 10); class 1 covers its head at its first.
    assert_eq!(q.pop(all), Some((1, "small")));
    assert_eq!(q.deficit(1), 0, "emptied");
    assert_eq!(q.pop(all), Some((0, "big")));
    assert_eq!(q.deficit(0), 12 - 10);
    // Cost 0 and exact multiples.
    let mut q = queue(&[4], QueueOrder::Fcfs);
    q.push(0, "zero", 0).unwrap();
    q.push(0, "eight", 8).unwrap();
    q.push(0, "last", 1).unwrap();
    assert_eq!(q.pop(all), Some((0, "zero")));
    assert_eq!(q.deficit(0), 4);
    assert_eq!(q.pop(all), Some((0, "eight")));
    assert_eq!(q.deficit(0), 4 + 4 - 8);
}

#[test]
fn bulk_credit_matches_looped_rounds() {
    // Weights 2, 3; heads 9 and 9: class 0 needs 5 visits, class 1 needs 3. Looping from
    // class 0: visits 0,1,0,1,0,1 -> class 1 covers first, after 3 visits of class 0 (6).
    let mut q = queue(&[2, 3], QueueOrder::Fcfs);
    q.push(0, "a", 9).unwrap();
    q.push(0, "a2", 9).unwrap();
    q.push(1, "b", 9).unwrap();
    q.push(1, "b2", 9).unwrap();
    assert_eq!(q.pop(all), Some((1, "b")));
    assert_eq!((q.deficit(0), q.deficit(1)), (6, 0));
    // Then visits 0 (8), 1 (3), 0 (10 >= 9): class 0 dispatches; class 1 got one visit.
    assert_eq!(q.pop(all), Some((0, "a")));
    assert_eq!((q.deficit(0), q.deficit(1)), (1, 3));
}

#[test]
fn class_keeps_the_turn_while_its_deficit_covers_its_head() {
    let mut q = queue(&[100, 100], QueueOrder::Fcfs);
    for item in ["a0", "a1", "a2", "a3"] {
        q.push(0, item, 30).unwrap();
    }
    for item in ["b0", "b1"] {
        q.push(1, item, 30).unwrap();
    }
    let order: Vec<_> = std::iter::from_fn(|| q.pop(all)).map(|(_, i)| i).collect();
    // 100 covers three heads of 30; the fourth waits for class 0's next visit.
    assert_eq!(order, ["a0", "a1", "a2", "b0", "b1", "a3"]);
}

#[test]
fn blocked_head_in_turn_passes_the_turn() {
    let mut q = queue(&[100, 100], QueueOrder::Fcfs);
    q.push(0, "a0", 10).unwrap();
    q.push(0, "a1", 10).unwrap();
    q.push(1, "b0", 10).unwrap();
    assert_eq!(q.pop(all), Some((0, "a0")));
    // Class 0 still has deficit 90, but its head is blocked now.
    assert_eq!(q.pop(|_, i| *i != "a1"), Some((1, "b0")));
    assert_eq!(q.deficit(0), 90);
    // Next visit to class 0 credits a quantum on top of what it kept.
    assert_eq!(q.pop(all), Some((0, "a1")));
    assert_eq!(q.deficit(0), 0, "emptied");
}

#[test]
fn pop_with_everything_blocked_changes_nothing() {
    let mut q = queue(&[7, 11, 13], QueueOrder::Wspt);
    q.push(0, "a", 20).unwrap();
    q.push(0, "a2", 20).unwrap();
    q.push(1, "b", 5).unwrap();
    q.push(2, "c", 50).unwrap();
    q.push(2, "c2", 50).unwrap();
    assert_eq!(q.pop(|c, _| c == 2), Some((2, "c")));
    let before = (
        q.levels[0].cursor,
        q.levels[0].in_turn,
        [q.deficit(0), q.deficit(1), q.deficit(2)],
    );
    let mut calls = Vec::new();
    let got = q.pop(|c, i| {
        calls.push((c, *i));
        false
    });
    assert_eq!(got, None);
    let after = (
        q.levels[0].cursor,
        q.levels[0].in_turn,
        [q.deficit(0), q.deficit(1), q.deficit(2)],
    );
    assert_eq!(before, after);
    assert_eq!(q.len(), 4);
    // Each class's head asked once.
    calls.sort();
    assert_eq!(calls, [(0, "a"), (1, "b"), (2, "c2")]);
    assert_eq!(queue(&[1], QueueOrder::Fcfs).pop(all), None);
}
