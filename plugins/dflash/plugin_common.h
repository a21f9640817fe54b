/*
 * What the DFlashAccept and DFlashTreeAccept plugin classes share: shape text and checks, the logits' dtype, the
 * tensors' formats, the capability interfaces. Header-only, TensorRT interfaces only (no libnvinfer symbols).
 */
#pragma once

#include "NvInfer.h"
#include "dflash_accept_kernel.h"

#include <cstdint>
#include <string>

namespace trtllm_dflash
{

// Two dimensions that may be equal: a negative one (a wildcard while building) matches anything.
inline bool sameOrUnknown(int64_t a, int64_t b)
{
    return a < 0 || b < 0 || a == b;
}

// "[2, 16, 4096]"
inline std::string dimsToString(nvinfer1::Dims const& dims)
{
    std::string text = "[";
    for (int32_t i = 0; i < dims.nbDims; ++i)
    {
        text += (i > 0 ? ", " : "") + std::to_string(dims.d[i]);
    }
    return text + "]";
}

// The kernels' name for a logits dtype; false for any dtype but float32 / float16 / bfloat16.
inline bool logitsTypeOf(nvinfer1::DataType type, DFlashLogitsType& out)
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT: out = DFlashLogitsType::kFLOAT32; return true;
    case nvinfer1::DataType::kHALF: out = DFlashLogitsType::kFLOAT16; return true;
    case nvinfer1::DataType::kBF16: out = DFlashLogitsType::kBFLOAT16; return true;
    default: return false;
    }
}

// supportsFormatCombination of both plugins, for one tensor of the expected count: linear, the target logits float32 /
// float16 / bfloat16, the temperature and the noise float32, every other input and every output int32.
inline bool acceptFormatSupported(int32_t pos, nvinfer1::PluginTensorDesc const& desc, int32_t targetLogits,
    int32_t temperature, int32_t gumbelNoise)
{
    if (desc.format != nvinfer1::TensorFormat::kLINEAR)
    {
        return false;
    }
    if (pos == targetLogits)
    {
        return desc.type == nvinfer1::DataType::kFLOAT || desc.type == nvinfer1::DataType::kHALF
            || desc.type == nvinfer1::DataType::kBF16;
    }
    if (pos == temperature || pos == gumbelNoise)
    {
        return desc.type == nvinfer1::DataType::kFLOAT;
    }
    return desc.type == nvinfer1::DataType::kINT32;
}

// getCapabilityInterface of a plugin class that implements the three IPluginV3One interfaces.
template <typename Plugin>
nvinfer1::IPluginCapability* capabilityOf(Plugin* plugin, nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(plugin);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(plugin);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(plugin);
    }
    return nullptr;
}

} // namespace trtllm_dflash
