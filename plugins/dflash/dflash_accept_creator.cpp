/*
 * The DFlashAccept and DFlashTreeAccept plugins' creators and the library's entry points (getCreators, setLoggerFinder), as in
 * NVIDIA TensorRT's plugin/vc/vfcCommon.cpp.
 */
#include "dflash_accept_plugin.h"

#include <cstdio>
#include <exception>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string_view>

using namespace nvinfer1;

namespace trtllm_dflash
{
namespace
{

std::mutex gLoggerMutex;
ILoggerFinder* gLoggerFinder{nullptr};

} // namespace

// TensorRT's logger when the library was loaded by TensorRT (setLoggerFinder), else stderr: an error of a
// noexcept interface method must leave a message somewhere, since all TensorRT sees is a status code.
void logPluginError(std::string const& message, char const* plugin) noexcept
{
    try
    {
        std::string const line = std::string(plugin) + ": " + message;
        ILogger* logger{nullptr};
        {
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            logger = gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
        }
        if (logger != nullptr)
        {
            logger->log(ILogger::Severity::kERROR, line.c_str());
        }
        else
        {
            std::fprintf(stderr, "%s\n", line.c_str());
        }
    }
    catch (...)
    {
    }
}

// IPluginCreatorV3One

DFlashAcceptPluginCreator::DFlashAcceptPluginCreator()
{
    mFields.emplace_back(kBlockSizeField, nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back(kMaskTokenIdField, nullptr, PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

char const* DFlashAcceptPluginCreator::getPluginName() const noexcept
{
    return kPluginName;
}

char const* DFlashAcceptPluginCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* DFlashAcceptPluginCreator::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

PluginFieldCollection const* DFlashAcceptPluginCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

namespace
{
// ONNX INT attributes reach us as kINT32 through TensorRT's ONNX parser; kINT64 is accepted for callers
// that build the collection themselves from 64-bit values.
int32_t readInt32Field(PluginField const& field)
{
    if (field.length != 1 || field.data == nullptr)
    {
        throw std::invalid_argument(std::string("attribute ") + field.name + " must be one integer");
    }
    if (field.type == PluginFieldType::kINT32)
    {
        return *static_cast<int32_t const*>(field.data);
    }
    if (field.type == PluginFieldType::kINT64)
    {
        int64_t const value = *static_cast<int64_t const*>(field.data);
        if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max())
        {
            throw std::invalid_argument(std::string("attribute ") + field.name + " does not fit in int32");
        }
        return static_cast<int32_t>(value);
    }
    throw std::invalid_argument(std::string("attribute ") + field.name + " must be int32 or int64");
}
} // namespace

IPluginV3* DFlashAcceptPluginCreator::createPlugin(
    char const* /* name */, PluginFieldCollection const* fc, TensorRTPhase /* phase */) noexcept
{
    try
    {
        if (fc == nullptr)
        {
            throw std::invalid_argument("no attributes given");
        }
        bool hasBlockSize = false;
        bool hasMaskTokenId = false;
        int32_t blockSize = 0;
        int32_t maskTokenId = 0;
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            PluginField const& field = fc->fields[i];
            std::string_view const fieldName = field.name != nullptr ? field.name : "";
            if (fieldName == kBlockSizeField)
            {
                blockSize = readInt32Field(field);
                hasBlockSize = true;
            }
            else if (fieldName == kMaskTokenIdField)
            {
                maskTokenId = readInt32Field(field);
                hasMaskTokenId = true;
            }
        }
        if (!hasBlockSize || !hasMaskTokenId)
        {
            throw std::invalid_argument("attributes block_size and mask_token_id are required");
        }
        return new DFlashAcceptPlugin(blockSize, maskTokenId);
    }
    catch (std::exception const& e)
    {
        logPluginError(std::string("cannot create the plugin: ") + e.what());
    }
    return nullptr;
}

// DFlashTreeAccept's creator: no attributes.

char const* DFlashTreeAcceptPluginCreator::getPluginName() const noexcept
{
    return kTreePluginName;
}

char const* DFlashTreeAcceptPluginCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* DFlashTreeAcceptPluginCreator::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

PluginFieldCollection const* DFlashTreeAcceptPluginCreator::getFieldNames() noexcept
{
    return &mNoFields;
}

IPluginV3* DFlashTreeAcceptPluginCreator::createPlugin(
    char const* /* name */, PluginFieldCollection const* /* fc */, TensorRTPhase /* phase */) noexcept
{
    try
    {
        return new DFlashTreeAcceptPlugin();
    }
    catch (std::exception const& e)
    {
        logPluginError(std::string("cannot create the plugin: ") + e.what(), kTreePluginName);
    }
    return nullptr;
}

} // namespace trtllm_dflash

extern "C" DFLASH_PLUGIN_EXPORT IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static trtllm_dflash::DFlashAcceptPluginCreator sCreator;
    static trtllm_dflash::DFlashTreeAcceptPluginCreator sTreeCreator;
    static IPluginCreatorInterface* const sCreators[] = {&sCreator, &sTreeCreator};
    nbCreators = 2;
    return sCreators;
}

extern "C" DFLASH_PLUGIN_EXPORT void setLoggerFinder(ILoggerFinder* finder)
{
    std::lock_guard<std::mutex> lock(trtllm_dflash::gLoggerMutex);
    if (trtllm_dflash::gLoggerFinder == nullptr && finder != nullptr)
    {
        trtllm_dflash::gLoggerFinder = finder;
    }
}
