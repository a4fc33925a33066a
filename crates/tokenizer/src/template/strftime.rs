//! `strftime_now(format)`, the clock HF chat templates may read (Llama 3.x prints today's date).
//!
//! transformers calls Python's `datetime.now().strftime(format)`, the engine's local time;
//! engines run in UTC almost always, so this uses UTC. Supported codes: `%a %A %b %B %d %e
//! %H %I %j %m %M %p %S %y %Y %Z %z %F %T %%`, and glibc's `%-d %-m %-H %-I %-M %-S`
//! (no padding). Other codes are written as they are, as glibc does.

use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The template function: the current UTC time formatted with `format`.
pub(crate) fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    strftime(format, secs)
}

/// Broken-down UTC time.
struct Civil {
    year: i64,
    month: u32,  // 1..=12
    day: u32,    // 1..=31
    yday: u32,   // 1..=366
    wday: usize, // 0 = Sunday
    hour: u32,
    minute: u32,
    second: u32,
}

impl Civil {
    /// Howard Hinnant's `civil_from_days`, for seconds since the Unix epoch.
    fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = BEFORE[month as usize - 1] + day + u32::from(leap && month > 2);
        Civil {
            year,
            month,
            day,
            yday,
            wday: (days + 4).rem_euclid(7) as usize,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
        }
    }
}

/// `format` applied to the UTC time `unix_secs`.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    let t = Civil::from_unix(unix_secs);
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |n: u32| {
            if pad {
                format!("{n:02}")
            } else {
                n.to_string()
            }
        };
        match spec {
            Some('a') => out.push_str(&DAYS[t.wday][..3]),
            Some('A') => out.push_str(DAYS[t.wday]),
            Some('b') | Some('h') => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[t.month as usize - 1]),
            Some('d') => out.push_str(&num(t.day)),
            Some('e') => out.push_str(&format!("{:>2}", t.day)),
            Some('H') => out.push_str(&num(t.hour)),
            Some('I') => out.push_str(&num(hour12)),
            Some('j') => out.push_str(&format!("{:03}", t.yday)),
            Some('m') => out.push_str(&num(t.month)),
            Some('M') => out.push_str(&num(t.minute)),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('S') => out.push_str(&num(t.second)),
            Some('y') => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('F') => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            Some('T') => out.push_str(&format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::strftime;

    #[test]
    fn formats_like_python() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %-d, %y", t), "Friday July 26, 24");
        assert_eq!(
            strftime("%F %T %p %I %j %Z", t),
            "2024-07-26 13:05:09 PM 01 208 UTC"
        );
        assert_eq!(strftime("100%% %q", t), "100% %q");
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }
}
