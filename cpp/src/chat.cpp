// dgr::ChatTemplate and dgr::ChatParser over llama.cpp's common/chat (see dgr/chat.h).
#include "dgr/chat.h"

#include <random>
#include <stdexcept>

#include "chat.h"
#include "json.h"

namespace dgr {
namespace {

bool starts_with(const std::string & s, const std::string & p) {
    return !p.empty() && s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

bool ends_with(const std::string & s, const std::string & p) {
    return !p.empty() && s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

const char * trigger_type_name(common_grammar_trigger_type t) {
    switch (t) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:        return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:         return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:      return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "unknown";
}

common_json strings(const std::vector<std::string> & v) {
    common_json out = common_json::array();
    for (const auto & s : v) {
        out.push_back(s);
    }
    return out;
}

std::string tool_call_id() {
    static const char chars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    thread_local std::mt19937 rng{std::random_device{}()};
    std::uniform_int_distribution<int> pick(0, (int) sizeof(chars) - 2);
    std::string id = "call_";
    for (int i = 0; i < 24; i++) {
        id += chars[pick(rng)];
    }
    return id;
}

common_json tool_call_json(const common_chat_tool_call & c) {
    common_json out = common_json::object();
    out["id"]        = c.id;
    out["name"]      = c.name;
    out["arguments"] = c.arguments;
    return out;
}

}  // namespace

struct ChatTemplate::Impl {
    common_chat_templates_ptr plain;
    common_chat_templates_ptr tool_use;  // null: the plain template serves tools too
    std::string bos, eos;
    bool add_bos = false, add_eos = false;
};

ChatTemplate::ChatTemplate(const std::string & source, const std::string & tool_use,
                           const std::string & bos, const std::string & eos, bool add_bos,
                           bool add_eos) : impl_(new Impl()) {
    if (source.empty()) {
        throw std::invalid_argument("the chat template is empty");
    }
    impl_->plain = common_chat_templates_init(nullptr, source, bos, eos);
    if (!tool_use.empty()) {
        impl_->tool_use = common_chat_templates_init(nullptr, tool_use, bos, eos);
    }
    impl_->bos = bos;
    impl_->eos = eos;
    impl_->add_bos = add_bos;
    impl_->add_eos = add_eos;
}

ChatTemplate::~ChatTemplate() = default;

std::string ChatTemplate::apply(const std::string & request_json) const {
    const common_json req = common_json::parse(request_json);
    if (!req.is_object()) {
        throw std::invalid_argument("a chat request must be a JSON object");
    }
    common_chat_templates_inputs in;
    in.messages = common_chat_msgs_parse_oaicompat(req.value("messages", common_json::array()));
    in.tools    = common_chat_tools_parse_oaicompat(req.value("tools", common_json()));
    in.tool_choice = common_chat_tool_choice_parse_oaicompat(
        req.value("tool_choice", std::string("auto")));
    in.parallel_tool_calls   = req.value("parallel_tool_calls", false);
    in.json_schema           = req.value("json_schema", std::string());
    in.grammar               = req.value("grammar", std::string());
    in.add_generation_prompt = req.value("add_generation_prompt", true);
    in.reasoning_format      = common_reasoning_format_from_name(
        req.value("reasoning_format", std::string("auto")));
    in.enable_thinking       = req.value("enable_thinking", true);
    const common_json kwargs = req.value("chat_template_kwargs", common_json::object());
    for (const auto & item : kwargs.items()) {
        in.chat_template_kwargs[item.key()] = item.value().dump();
    }
    const bool tools = !in.tools.empty() && impl_->tool_use;
    const auto * t = tools ? impl_->tool_use.get() : impl_->plain.get();
    common_chat_params p = common_chat_templates_apply(t, in);

    // as llama.cpp's own chat code does when the vocabulary adds BOS/EOS itself
    if (impl_->add_bos && starts_with(p.prompt, impl_->bos)) {
        p.prompt = p.prompt.substr(impl_->bos.size());
    }
    if (impl_->add_eos && ends_with(p.prompt, impl_->eos)) {
        p.prompt = p.prompt.substr(0, p.prompt.size() - impl_->eos.size());
    }

    common_json out = common_json::object();
    out["prompt"]       = p.prompt;
    out["format"]       = (int) p.format;
    out["format_name"]  = std::string(common_chat_format_name(p.format));
    out["grammar"]      = p.grammar;
    out["grammar_lazy"] = p.grammar_lazy;
    common_json triggers = common_json::array();
    for (const auto & tr : p.grammar_triggers) {
        common_json j = common_json::object();
        j["type"]  = std::string(trigger_type_name(tr.type));
        j["value"] = tr.value;
        j["token"] = (int) tr.token;
        triggers.push_back(j);
    }
    out["grammar_triggers"]   = triggers;
    out["preserved_tokens"]   = strings(p.preserved_tokens);
    out["additional_stops"]   = strings(p.additional_stops);
    out["generation_prompt"]  = p.generation_prompt;
    out["parser"]             = p.parser;
    out["supports_thinking"]  = p.supports_thinking;
    out["thinking_start_tag"] = p.thinking_start_tag;
    out["thinking_end_tags"]  = strings(p.thinking_end_tags);
    return out.dump();
}

std::string ChatTemplate::caps() const {
    common_json out = common_json::object();
    const auto * t = impl_->tool_use ? impl_->tool_use.get() : impl_->plain.get();
    for (const auto & kv : common_chat_templates_get_caps(t)) {
        out[kv.first] = kv.second;
    }
    return out.dump();
}

struct ChatParser::Impl {
    common_chat_parser_params params;
    std::string text;
    common_chat_msg msg;
    std::vector<std::string> ids;
};

ChatParser::ChatParser(const std::string & params_json) : impl_(new Impl()) {
    const common_json j = common_json::parse(params_json);
    auto & p = impl_->params;
    p.format = (common_chat_format) j.value("format", 0);
    p.reasoning_format = common_reasoning_format_from_name(
        j.value("reasoning_format", std::string("auto")));
    p.reasoning_in_content = j.value("reasoning_in_content", false);
    p.generation_prompt = j.value("generation_prompt", std::string());
    p.parse_tool_calls = j.value("parse_tool_calls", true);
    const std::string parser = j.value("parser", std::string());
    if (!parser.empty()) {
        p.parser.load(parser);
    }
}

ChatParser::~ChatParser() = default;

std::string ChatParser::update(const std::string & text, bool partial) {
    auto & s = *impl_;
    s.text += text;
    common_chat_msg prev = s.msg;
    common_chat_msg now = common_chat_parse(s.text, partial, s.params);
    common_json diffs = common_json::array();
    if (!now.empty() || !partial) {
        now.set_tool_call_ids(s.ids, tool_call_id);
        s.msg = now;
        for (const auto & d : common_chat_msg_diff::compute_diffs(prev, s.msg)) {
            common_json jd = common_json::object();
            jd["content_delta"] = d.content_delta;
            jd["reasoning_content_delta"] = d.reasoning_content_delta;
            jd["tool_call_index"] =
                d.tool_call_index == std::string::npos ? (int64_t) -1 : (int64_t) d.tool_call_index;
            jd["tool_call"] = tool_call_json(d.tool_call_delta);
            diffs.push_back(jd);
        }
    }
    common_json m = common_json::object();
    m["content"] = s.msg.content;
    m["reasoning_content"] = s.msg.reasoning_content;
    common_json calls = common_json::array();
    for (const auto & c : s.msg.tool_calls) {
        calls.push_back(tool_call_json(c));
    }
    m["tool_calls"] = calls;
    common_json out = common_json::object();
    out["message"] = m;
    out["diffs"] = diffs;
    return out.dump();
}

}  // namespace dgr
