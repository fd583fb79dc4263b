//! Prometheus text exposition lines, as the engines' `/metrics` pages send them: the two
//! readers both the engine presets and the LoRA residency parser use.

/// `name{labels} value [timestamp]` → its parts (the value may be `NaN` or infinite); `None` for
/// anything else.
pub(crate) fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) if line[..open].find(' ').is_none() => {
            // The closing brace must follow the opening one (`x}{ 1` once panicked here).
            let close = open + line[open..].rfind('}')?;
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        _ => {
            let sp = line.find(char::is_whitespace)?;
            (&line[..sp], "", &line[sp..])
        }
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

/// The value of `key` in a label set (`a="1",b="x\"y"`), escapes left as sent.
pub(crate) fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].strip_prefix('"')?;
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let end = end?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].trim_start_matches(',');
    }
    None
}
